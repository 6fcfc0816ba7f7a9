"""The scripted expert searcher: the teacher whose episodes warm-start the model (issue 13, item 6).

It reads only what a model would (the decoded context of the sample it continues) plus the task's
plan (`metadata["queries"]`: one query per hop, written from the clues and, after the first hop,
the bridge entity's name; `metadata["targets"]`). Each turn, in order:

1. past half the budget or just refused, with chunks of non-target documents in view and no
   prune just made: prune them all in one call (batched, as the prune-streak penalty asks),
   with the next search or read in the same turn when both fit (parallel calls);
2. the first missing target's hop query not yet searched: search_corpus(query);
3. searched but still missing: read_document(target);
4. every target in view, past the hard cutoff, refused, or nothing left to try: the final
   output, the targets seen, in chain order.

It is an honest teacher, not an oracle: what it outputs is what it saw, and a search that did not
surface a document costs it a read.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from slipstream.envs.base import TaskSpec
from slipstream.envs.search.tools import PRUNE, READ, SEARCH, doc_of

if TYPE_CHECKING:
    from slipstream.envs.search.env import SearchOptions

_CALL = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)
_CHUNK = re.compile(r'<chunk id="([^"]+)">')
_USAGE = re.compile(r"\[Token usage: ([\d,]+)/([\d,]+)\]")


def call(name: str, **args: Any) -> str:
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
    prune = (used > budget / 2 or refused) and irrelevant and not (calls and calls[-1][0] == PRUNE)
    missing = [t for t in targets if t not in visible_docs]
    action = ""
    if missing and not refused and used < options.hard_cutoff * budget:
        hop = targets.index(missing[0])
        searched = {str(a.get("query")) for n, a in calls if n == SEARCH}
        read = {str(a.get("doc_id")) for n, a in calls if n == READ}
        if queries[hop] not in searched:
            action = call(SEARCH, query=queries[hop])
        elif missing[0] not in read:
            action = call(READ, doc_id=missing[0])
    if prune:
        # One batched prune, with the next search in the same turn when both fit in a response
        # (the reserve bounds its length): parallel calls, as the system prompt asks.
        line = _fit_prune(irrelevant, action, options.reserve_tokens) or _fit_prune(
            irrelevant, "", options.reserve_tokens
        )
        if line:
            return line
    if action:
        return action + "\n"
    return answer([t for t in targets if t in visible_docs])


def _fit_prune(ids: list[str], action: str, limit: int) -> str:
    """prune_chunks of as many of `ids` as fit with `action` in `limit` bytes; "" if none fits."""
    ids = list(ids)
    while ids:
        line = call(PRUNE, chunk_ids=ids) + action + "\n"
        if len(line.encode()) < limit:
            return line
        ids.pop()
    return ""


def answer(doc_ids: list[str]) -> str:
    return f"<docs>{' '.join(doc_ids)}</docs>\n"
