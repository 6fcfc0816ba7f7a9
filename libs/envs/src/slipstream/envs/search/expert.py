"""The scripted expert searcher: the teacher whose episodes warm-start the model (issue 13, item 6).

It reads only what a model would (the decoded context of the sample it continues) plus the task's
plan (`metadata["queries"]`: one query per hop, written from the clues and, after the first hop,
the bridge entity's name; `metadata["targets"]`). Each turn, in order:

1. past half the budget or just refused, with chunks of non-target documents in view and no
   prune just made: prune them all in one call (batched, as the prune-streak penalty asks),
   with the next search or read in the same turn when both fit (parallel calls);
2. the first missing target's hop query not yet searched: search_corpus(query) (with
   `expert_grep`, the first hop is grep_corpus on the clues instead: the region's name and the
   decade's first three digits, `north. It dates from 187`, which finds the document whose text
   says both, where a BM25 search for "1870s" matches no year);
3. searched but still missing: read_document(target) (with `expert_fallback` "grep", the first
   hop is grepped on its clues first, as expert_grep greps them, and read only if that fails);
4. every target in view, past the hard cutoff, refused, or nothing left to try: the final
   output, the targets seen, in chain order.

`expert_prune_rate` is the share of tasks on which it prunes at all (a teacher without the
behaviour, for RL to raise: on the other tasks it never prunes, is refused at the hard cutoff and
concludes with what it saw). `expert_stop_rate` / `expert_distractor_rate` / `expert_slip_rate`
make it an imperfect teacher,
as a stronger model's trajectories are: on a fixed share of tasks it concludes one hop short (the
answer document missing), on another it adds a non-target document it saw to the output, on
another (with `expert_grep`) its first grep names the neighbouring decade, and it greps again. With nothing to output
it names a non-target it saw rather than an empty list. It is an honest teacher, not an oracle:
what it outputs is what it saw, and a search that did not surface a document costs it a read.
"""

from __future__ import annotations

import json
import re
from typing import Any

from slipstream.envs.base import TaskSpec, fixed_draw
from slipstream.envs.search.options import SearchOptions
from slipstream.envs.search.tools import GREP, PRUNE, READ, SEARCH, doc_of

_CALL = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)
_CHUNK = re.compile(r'<chunk id="([^"]+)">')
_SEEN = re.compile(r'<chunk id="([^"]+)">|\[pruned: ([^\]]+)\]')
_USAGE = re.compile(r"\[Token usage: ([\d,]+)/([\d,]+)\]")


def call(name: str, /, **args: Any) -> str:
    return "<tool>" + json.dumps({"name": name, "args": args}, ensure_ascii=False) + "</tool>"


def _calls(context: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for body in _CALL.findall(context):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("args"), dict):
            out.append((str(obj.get("name")), obj["args"]))
    return out


def next_turn(task: TaskSpec, context: str, options: SearchOptions) -> str:
    """The expert's next line, given the decoded context (prompt included)."""
    targets = task.metadata["targets"].split()
    queries = task.metadata["queries"].split("|")
    calls = _calls(context)
    visible = list(dict.fromkeys(_CHUNK.findall(context)))
    visible_docs = {doc_of(c) for c in visible}
    usage = _USAGE.findall(context)
    used = int(usage[-1][0].replace(",", "")) if usage else 0
    budget = options.budget_tokens
    refused = context.rfind("refused, ") > context.rfind("<tool>")
    irrelevant = [c for c in visible if doc_of(c) not in targets]
    key = task.metadata.get("key", task.task_id)
    prunes = _draw(key, "prune") < options.expert_prune_rate
    prune = prunes and (used > budget / 2 or refused) and irrelevant and not (calls and calls[-1][0] == PRUNE)
    missing = [t for t in targets if t not in visible_docs]
    # The imperfect teacher: on a fixed share of tasks it stops one hop short.
    stop_early = _draw(key, "stop") < options.expert_stop_rate and missing == [targets[-1]]
    action = ""
    if missing and not refused and not stop_early and used < options.hard_cutoff * budget:
        hop = targets.index(missing[0])
        searched = {str(a.get("query")) for n, a in calls if n == SEARCH}
        grepped = [str(a.get("pattern")) for n, a in calls if n == GREP]
        read = {str(a.get("doc_id")) for n, a in calls if n == READ}
        fixed = options.fixed_offsets
        pattern = grep_pattern(queries[0], fixed=fixed) if hop == 0 and options.expert_grep else ""
        if pattern and not grepped and _draw(key, "slip") < options.expert_slip_rate:
            action = call(GREP, pattern=grep_pattern(queries[0], slip=True, fixed=fixed))
        elif pattern and pattern not in grepped:
            action = call(GREP, pattern=pattern)
        elif not pattern and queries[hop] not in searched:
            action = call(SEARCH, query=queries[hop])
        elif hop == 0 and options.expert_fallback == "grep" and (clue := grep_pattern(queries[0])) not in grepped:
            action = call(GREP, pattern=clue)
        elif missing[0] not in read:
            action = call(READ, doc_id=missing[0])
    if prune:
        # One batched prune, with the next search in the same turn when both fit in a response
        # (the reserve bounds its length): parallel calls, as the system prompt asks. When the
        # action would crowd chunk ids out of the line, the prune goes alone (every id that fits).
        line, n = _fit_prune(irrelevant, action, options.reserve_tokens)
        if n < len(irrelevant):
            line, _ = _fit_prune(irrelevant, "", options.reserve_tokens)
        if line:
            return line
    if action:
        return action + "\n"
    output = [t for t in targets if t in visible_docs]
    seen = (doc_of(m.group(1) or m.group(2)) for m in _SEEN.finditer(context))
    seen_other = [d for d in dict.fromkeys(seen) if d not in targets]
    if seen_other and (not output or _draw(key, "distractor") < options.expert_distractor_rate):
        output.append(seen_other[0])  # a non-target it saw: the imperfect teacher's precision slip
    return answer(output)


def grep_pattern(query: str, *, slip: bool = False, fixed: bool = False) -> str:
    """The first hop's grep from its planned query (`town north 1870s`): `north. It dates from 187`,
    or with `fixed` (the `fixed_offsets` corpus, whose documents open with their year) `from 187.*north`:
    the decade's digits first, so they sit a fixed distance after the question's last words.

    `slip`: the neighbouring decade instead (the imperfect teacher's wrong first try)."""
    words = query.split()
    region, decade = words[-2], words[-1].rstrip("s")
    prefix = int(decade[:3])
    if slip:
        prefix = prefix + 1 if prefix < 199 else prefix - 1
    return f"from {prefix}.*{region}" if fixed else f"{region}. It dates from {prefix}"


def _draw(key: str, what: str) -> float:
    """A fixed number in [0, 1) per (task key, what): the teacher's slips are a function of the task."""
    return fixed_draw(f"search-expert:{what}:{key}")


def _fit_prune(ids: list[str], action: str, limit: int) -> tuple[str, int]:
    """prune_chunks of as many of `ids` as fit with `action` in `limit` bytes, and how many that is;
    ("", 0) if none fits."""
    ids = list(ids)
    while ids:
        line = call(PRUNE, chunk_ids=ids) + action + "\n"
        if len(line.encode()) < limit:
            return line, len(ids)
        ids.pop()
    return "", 0


def answer(doc_ids: list[str]) -> str:
    return f"<docs>{' '.join(doc_ids)}</docs>\n"
