"""`recall`: facts arrive over many turns and one early fact is asked for at the end.

The task family for self-summaries versus truncation (issue 14): a context budget smaller than the
episode forces the harness to restart the context (libs/harness summary.py), and only a restart
that carried the facts forward lets the policy answer. One episode, byte for byte:

    [bos]recall\\n                 prompt
    c=Q\\n                         observation: a fact (key letter, value: uppercase letters)
    ok\\n                          sampled: the policy acknowledges (stops at "\\n")
    ~qxvtspwr\\n                   observation: filler, nothing to remember
    ok\\n
    ...                           `turns` observations in all, `facts` of them facts
    c?\\n                          observation: the question, about one of the facts
    Q\\n                           sampled: the answer

With summaries on, when the context reaches the group's threshold the harness appends the
request (`SUMMARY_REQUEST`, "<summary>") and the policy writes the facts it can see
("c=Q a=X</summary>"); the context restarts from the prompt, that summary and the line
still waiting for an acknowledgement. With truncation (the baseline) the context restarts from
the prompt and its last tokens, so a fact survives only if it arrived late.

The task's key spells the whole episode ("cQ.aX|1.5|c|0042": facts, the turns they arrive at,
the question, a nonce), so any process rebuilds it from `metadata["key"]`; the filler lines are a
hash of the key.
Held-out keys are never trained on. Scoring: `correct` (1.0) when the answer line is the value.

`expert` is the scripted teacher that warm-starts the model: it acknowledges, writes every fact
it can see into a summary, and answers from what it can see ("?" when the fact is gone, so
its warm-start examples never teach a random guess). `expert_drop_rate` makes it imperfect: on
that fraction of tasks its summaries leave out the first fact they could carry (so it cannot
answer a question about it); RL has to unlearn that.

**Learned timing and content (issue 33, `examples/recall_learned.toml`).** With `cue` the prompt
names the fact that will be asked (`recall b`), and with the harness's `policy` summaries
(libs/harness summary.py) the policy may open `<summary>` itself at any turn, while a context
that reaches the threshold unsummarised is truncated. So *when* to summarise (after the asked
fact arrived, before the cut) and *what* to keep (the asked fact, not the others) both decide the
outcome, and neither is the teacher's: `expert_self_summary` makes the teacher summarise once, at
a turn drawn per task or (`expert_trigger`) at the first filler line that begins with one of some
letters, a cue it can see that has nothing to do with the outcome; `expert_keep` = "one" keeps one
fact in view drawn per task, "first" / "last" the earliest / latest fact in view, whichever was asked.
`expert_answer` = "summary" makes the teacher read its summary's value back where the asked fact is
gone (instead of "?"), so reading back is one copy and the outcome turns on when and what it kept.
`eval_metrics` reports when summaries opened (`summary_at_turn_<k>`, the share of episodes whose
first one opened at turn k), how often (`summarised`), and what they kept (`kept_asked`).
"""

from __future__ import annotations

import hashlib
import random
import re
import string
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

import msgspec

from slipstream.envs.base import Environment, Problem, Score, TaskSpec, fixed_draw
from slipstream.envs.context import EpisodeContext, Outcome
from slipstream.envs.registry import register

if TYPE_CHECKING:
    from slipstream.schemas import Episode

Doc = msgspec.Meta

PROMPT = "recall\n"
ACK = "ok"
UNKNOWN = "?"  # the expert's answer when the fact is not in its context
SUMMARY_REQUEST = "<summary>"
SUMMARY_END = "</summary>"
# The restart the harness writes after a summary: the summary and the number of summaries so far.
SUMMARY_RESTART = "<summary>{summary}</summary>[{n}]\n"
TRUNCATED = "\n[truncated]\n"  # the harness's mark where a restart cut the context (libs/harness summary.py)
KEY_LETTERS = "abcdefgh"
FILLER_LETTERS = "pqrstuvwxyz"
VALUE_CHARS = string.ascii_uppercase + string.digits
_FACT = re.compile(r"(?<![a-z])([a-h])=([A-Z0-9]+)")
_QUESTION = re.compile(r"(?:^|\n)([a-h])\?\n$")
# A summary as the harness used it: up to its end tag, or to the end of the link when the budget cut it.
_SUMMARY = re.compile(re.escape(SUMMARY_REQUEST) + r"(.*?)(?:" + re.escape(SUMMARY_END) + r"|\Z)", re.S)
_KEY = re.compile(r"^((?:[a-h][A-Z0-9]{1,3}\.)*[a-h][A-Z0-9]{1,3})\|((?:\d+\.)*\d+)\|([a-h])\|\d{4}$")


class RecallOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Options of `recall`; `get_env("recall", turns=10)`."""

    facts: Annotated[int, Doc(description="Facts per episode (distinct key letters a-h).")] = 1
    key_letters: Annotated[str, Doc(description="Letters the facts' keys are drawn from (a-h).")] = KEY_LETTERS
    value_chars: Annotated[
        str, Doc(description="Characters a fact's value is drawn from (uppercase letters or digits).")
    ] = string.ascii_uppercase
    value_len: Annotated[
        int, Doc(description="Characters in a value: a guess succeeds 1 in len(value_chars) ** value_len.")
    ] = 1
    turns: Annotated[int, Doc(description="Observations before the question (facts plus filler lines).")] = 8
    filler_len: Annotated[int, Doc(description="Letters in one filler line.")] = 8
    early: Annotated[
        int, Doc(description="Facts arrive within the first `early` turns (0: anywhere before the question).")
    ] = 0
    cue: Annotated[
        bool, Doc(description="The prompt names the fact that will be asked ('recall b'), so what to keep is knowable.")
    ] = False
    expert_self_summary: Annotated[
        bool,
        Doc(
            description="The teacher opens a summary itself (the harness's policy summaries) once, at a turn drawn "
            "uniformly per task, rather than only when the harness asks."
        ),
    ] = False
    expert_trigger: Annotated[
        str,
        Doc(
            description="With expert_self_summary: the teacher summarises at the first filler line that begins "
            "with one of these letters (a cue in its context, unrelated to the outcome, so a model can replay it); "
            "empty: at a turn drawn per task, which its context does not show."
        ),
    ] = ""
    expert_keep: Annotated[
        Literal["all", "one", "first", "last"],
        Doc(
            description="What the teacher's summaries keep: every fact in view, one drawn per task, or the earliest "
            "or the latest fact in view (any fact: not the asked one by design)."
        ),
    ] = "all"
    strict_ack: Annotated[
        bool,
        Doc(
            description="A line must be acknowledged with 'ok': any other reply ends the episode unanswered (so "
            "the policy cannot carry a fact in its own acknowledgements past a cut, only in a summary)."
        ),
    ] = False
    expert_answer: Annotated[
        Literal["lookup", "summary"],
        Doc(
            description="How the teacher answers when the asked fact is not in view: 'lookup' says '?'; 'summary' "
            "reads back the value of the first fact its latest summary holds, whatever its key (so reading back is "
            "one copy, and whether the answer is right depends only on what the summary kept)."
        ),
    ] = "lookup"
    expert_drop_rate: Annotated[
        float,
        Doc(description="Fraction of tasks on which the expert's summaries leave out the first fact they could carry."),
    ] = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.facts <= len(KEY_LETTERS):
            raise ValueError(f"facts must be in 1..{len(KEY_LETTERS)}, got {self.facts}")
        if not self.facts <= self.turns <= 64:
            raise ValueError(f"turns must be in facts..64 ({self.facts}..64), got {self.turns}")
        if (
            not self.key_letters
            or not set(self.key_letters) <= set(KEY_LETTERS)
            or len(set(self.key_letters)) < len(self.key_letters)
        ):
            raise ValueError(f"key_letters must be distinct letters of {KEY_LETTERS!r}, got {self.key_letters!r}")
        if len(self.key_letters) < self.facts:
            raise ValueError(f"need at least facts={self.facts} key_letters, got {self.key_letters!r}")
        if not self.value_chars or not set(self.value_chars) <= set(VALUE_CHARS):
            raise ValueError(f"value_chars must be uppercase letters or digits, got {self.value_chars!r}")
        if not 1 <= self.value_len <= 3:
            raise ValueError(f"value_len must be in 1..3, got {self.value_len}")
        if not 1 <= self.filler_len <= 64:
            raise ValueError(f"filler_len must be in 1..64, got {self.filler_len}")
        if self.early and not self.facts <= self.early <= self.turns:
            raise ValueError(f"early must be 0 or in facts..turns ({self.facts}..{self.turns}), got {self.early}")
        if self.expert_answer not in ("lookup", "summary"):
            raise ValueError(f"expert_answer must be 'lookup' or 'summary', got {self.expert_answer!r}")
        if self.expert_keep not in ("all", "one", "first", "last"):
            raise ValueError(f"expert_keep must be 'all', 'one', 'first' or 'last', got {self.expert_keep!r}")
        if not set(self.expert_trigger) <= set(FILLER_LETTERS):
            raise ValueError(f"expert_trigger must be letters of {FILLER_LETTERS!r}, got {self.expert_trigger!r}")
        if not 0.0 <= self.expert_drop_rate <= 1.0:
            raise ValueError(f"expert_drop_rate must be in [0, 1], got {self.expert_drop_rate}")


class Script(msgspec.Struct, frozen=True):
    """One episode as its key spells it."""

    facts: list[tuple[str, str]]
    at: list[int]
    question: str

    @property
    def answer(self) -> str:
        return dict(self.facts)[self.question]


def parse_key(key: str) -> Script:
    """The episode a key spells; ValueError naming the key when it is not one."""
    m = _KEY.match(key)
    if not m:
        raise ValueError(f"not a recall key: {key!r} (expected like 'cQ.aX|1.5|c|0042')")
    facts = [(f[0], f[1:]) for f in m.group(1).split(".")]
    at = [int(t) for t in m.group(2).split(".")]
    if len(at) != len(facts) or m.group(3) not in dict(facts):
        raise ValueError(f"not a recall key: {key!r} (one turn per fact, and a question about one of them)")
    return Script(facts=facts, at=at, question=m.group(3))


def _last_line(context: str) -> str:
    """The last whole line of `context` (the observation the policy is answering), without its newline."""
    return context.rpartition("\n")[0].rpartition("\n")[2]


def _turns(counts: dict[str, int], prefix: str) -> dict[int, int]:
    """{turn: count} of the episode counts named `<prefix><turn>` (libs/harness summarising.py)."""
    return {int(k[len(prefix) :]): v for k, v in counts.items() if k.startswith(prefix)}


@register("recall")
class Recall(Environment[RecallOptions]):
    """Multi-turn memory: acknowledge each line, then answer a question about an early fact."""

    version: ClassVar[str] = "1"
    Options: ClassVar[type[msgspec.Struct]] = RecallOptions
    components: ClassVar[tuple[str, ...]] = ("correct",)
    warmstart_from_expert: ClassVar[bool] = True

    @property
    def max_completion_chars(self) -> int:
        return 8

    # -- tasks ----------------------------------------------------------------------------------

    def sample(self, rng: random.Random) -> Problem:
        o = self.options
        keys = rng.sample(o.key_letters, o.facts)
        values = ["".join(rng.choice(o.value_chars) for _ in range(o.value_len)) for _ in keys]
        at = sorted(rng.sample(range(o.early or o.turns), o.facts))
        question = rng.choice(keys)
        key = ".".join(k + v for k, v in zip(keys, values, strict=True)) + "|" + ".".join(map(str, at)) + "|" + question
        key += f"|{rng.randrange(10000):04d}"  # a nonce: its filler lines (a hash of the key) are its own
        return Problem(
            key=key, prompt=self.prompt_for(question), reference=dict(zip(keys, values, strict=True))[question]
        )

    def prompt_for(self, question: str) -> str:
        """The task prompt: `recall`, with the asked key when `cue` is on."""
        return f"recall {question}\n" if self.options.cue else PROMPT

    def script(self, task: TaskSpec) -> Script:
        key = task.metadata.get("key", "")
        script = parse_key(key)
        if max(script.at) >= self.options.turns:
            raise ValueError(f"recall key {key!r} places a fact past turn {self.options.turns - 1}")
        return script

    def lines(self, task: TaskSpec) -> list[str]:
        """The `turns` observation lines of the task, facts and filler, each ending in a newline."""
        script = self.script(task)
        facts = dict(zip(script.at, script.facts, strict=True))
        out = []
        for t in range(self.options.turns):
            if t in facts:
                k, v = facts[t]
                out.append(f"{k}={v}\n")
            else:
                digest = hashlib.blake2b(f"recall:{task.metadata.get('key')}:{t}".encode(), digest_size=32).digest()
                letters = "".join(FILLER_LETTERS[b % len(FILLER_LETTERS)] for b in digest[: self.options.filler_len])
                out.append(f"~{letters}\n")
        return out

    # -- the read-back drill (the warm-start's `sft_drill_rows`) ----------------------------------------

    def drill_texts(self, n: int, seed: int) -> list[tuple[str, str]]:
        """Reading an answer back from a summary, as the context looks after a restart: the prompt,
        a summary of 0-3 facts, the filler lines since (on half the rows cut by the harness's
        truncation mark to their last tokens), the question.
        The target is the asked fact's value when the summary holds its key, otherwise "?" (or, with
        `expert_answer = "summary"`, the summary's first value), the asked key held on half the rows.
        It drills the lookup every successful episode ends with, and nothing RL is
        credited with: the summaries are drawn at random, not when or as the teacher writes them.
        (The micro model's warm-start on the teacher alone answered "?" to every clean probe
        episode's question, seed 0 of session 29: 4 in 5 of the teacher's answers are "?".)"""
        o = self.options
        rng = random.Random(f"recall-drill/{seed}")
        out = []
        for _ in range(n):
            keys = rng.sample(o.key_letters, min(len(o.key_letters), rng.randint(1, 4)))
            asked, others = keys[0], keys[1:]
            held = others[: rng.randint(0, len(others))]
            if rng.random() < 0.5:
                held = [*held, asked]
            rng.shuffle(held)
            facts = {k: "".join(rng.choice(o.value_chars) for _ in range(o.value_len)) for k in held}
            summary = " ".join(f"{k}={v}" for k, v in facts.items())
            filler = "".join(
                "~" + "".join(rng.choice(FILLER_LETTERS) for _ in range(o.filler_len)) + "\n" + ACK + "\n"
                for _ in range(3)
            )
            # After a later truncation (its mark and the last tokens), or straight after the summary.
            cut = rng.random() < 0.5
            tail = TRUNCATED + filler[-rng.randint(2 * (o.filler_len + 5) - 6, len(filler)) :] if cut else filler
            restart = SUMMARY_RESTART.format(summary=summary, n=rng.randint(1, 8))
            context = self.prompt_for(asked) + restart + tail + f"{asked}?\n"
            out.append((context, self._read_back(asked, facts) + self.terminator))
        return out

    # -- the teacher --------------------------------------------------------------------------------

    def _draw(self, task: TaskSpec, what: str) -> float:
        return fixed_draw(f"recall:{what}:{task.metadata.get('key')}")

    def expert(self, task: TaskSpec, context: str) -> str:
        """Acknowledge; summarise the facts in view (all, or one per `expert_keep`) when asked or at its
        own drawn turn (`expert_self_summary`); answer from the facts in view ("?" when gone)."""
        # A turn the engine cut (a summary opened within a few tokens) continues where it stopped.
        head, _, tail = context.rpartition("\n")
        opened = tail.startswith(SUMMARY_REQUEST) or (bool(tail) and SUMMARY_REQUEST.startswith(tail))
        if opened and not tail.endswith(SUMMARY_END):
            return self._summary(task, head)[len(tail) :]
        if context.endswith(SUMMARY_REQUEST):
            return self._summary(task, context)[len(SUMMARY_REQUEST) :]
        question = _QUESTION.search(context)
        if question:
            k = question.group(1)
            seen = self._seen(context)
            if k in seen:
                return seen[k] + self.terminator
            summaries = _SUMMARY.findall(context)
            return self._read_back(k, dict(_FACT.findall(summaries[-1])) if summaries else {}) + self.terminator
        if self.options.expert_self_summary and SUMMARY_END not in context and self._due(task, context):
            return self._summary(task, context)
        return ACK + self.terminator

    def _read_back(self, asked: str, summary: dict[str, str]) -> str:
        """The teacher's answer from a summary's facts: the asked one's value; else "?" (`lookup`) or
        the first value it holds (`summary`: one copy, right only when the summary kept the asked value)."""
        if asked in summary:
            return summary[asked]
        if self.options.expert_answer == "summary" and summary:
            return next(iter(summary.values()))
        return UNKNOWN

    @staticmethod
    def _seen(context: str) -> dict[str, str]:
        seen: dict[str, str] = {}
        for k, v in _FACT.findall(context):
            seen.setdefault(k, v)
        return seen

    def _summary(self, task: TaskSpec, context: str) -> str:
        """The teacher's whole summary of what `context` shows: "<summary>c=Q a=X</summary>"."""
        carried = list(self._seen(context).items())
        if carried and self._draw(task, "drop") < self.options.expert_drop_rate:
            carried = carried[1:]
        if carried and self.options.expert_keep == "one":
            carried = [carried[int(self._draw(task, "keep") * len(carried))]]
        if carried and self.options.expert_keep in ("first", "last"):
            carried = carried[:1] if self.options.expert_keep == "first" else carried[-1:]
        return SUMMARY_REQUEST + " ".join(f"{k}={v}" for k, v in carried) + SUMMARY_END

    def _due(self, task: TaskSpec, context: str) -> bool:
        """The teacher opens its own summary now: at its trigger line, or at its drawn turn."""
        trigger = self.options.expert_trigger
        if trigger:
            last = _last_line(context)
            return last.startswith("~") and last[1:2] in set(trigger)
        return self._turn(task, context) == self._when(task)

    def _when(self, task: TaskSpec) -> int:
        """The turn at which the teacher opens its own summary: uniform over the task's turns."""
        return int(self._draw(task, "when") * self.options.turns)

    def _turn(self, task: TaskSpec, context: str) -> int:
        """Which observation line the context ends with (-1 when it ends with none)."""
        last = _last_line(context) + "\n"
        lines = self.lines(task)
        return lines.index(last) if last in lines else -1

    # -- the episode ------------------------------------------------------------------------------

    async def run(self, ctx: EpisodeContext) -> Outcome:
        script = self.script(ctx.task)
        thread = ctx.open(ctx.task.prompt)
        for line in self.lines(ctx.task):
            ctx.observe(thread, line)
            ack = await ctx.generate(thread, max_tokens=4, stop=[self.terminator])
            if self.options.strict_ack and ack.text.removesuffix(self.terminator) != ACK:
                ctx.count("bad_ack")
                return Outcome(final_text="", finish_reason="bad_ack")
        ctx.observe(thread, f"{script.question}?\n")
        gen = await ctx.generate(thread, max_tokens=self.max_completion_chars, stop=[self.terminator])
        return Outcome(final_text=gen.text, finish_reason=gen.finish_reason)

    # -- scoring ------------------------------------------------------------------------------------

    def eval_metrics(self, tasks: list[TaskSpec], episodes: list[Episode]) -> dict[str, float]:
        """When, how often and what the policy summarised of its own accord (the harness's `policy`
        summaries; nothing when it never did): `summarised` (share of episodes), `policy_summaries`
        (per episode), `summary_turn` (mean turn of an episode's first one), `summary_at_turn_<k>`
        (share of episodes whose first one opened at turn k), `kept_asked` (share of summarised
        episodes whose summaries kept the asked fact), `kept_value` (the asked fact's value under any
        key); and for the fixed rule, `threshold_restarts`
        per episode and `threshold_turn` (mean turn of an episode's first)."""
        n = len(episodes) or 1
        forced = [_turns(e.counts, "threshold_at_turn_") for e in episodes]
        out: dict[str, float] = {}
        if any(forced):  # when the fixed rule first restarted the context (summary request or truncation)
            out["threshold_restarts"] = round(sum(sum(f.values()) for f in forced) / n, 4)
            firsts = [min(f) for f in forced if f]
            out["threshold_turn"] = round(sum(firsts) / len(firsts), 3)
        if not any(e.counts.get("policy_summaries") for e in episodes):
            return out
        first: list[int] = []
        kept = kept_value = 0
        for task, e in zip(tasks, episodes, strict=True):
            turns = _turns(e.counts, "summary_at_turn_")
            if not turns:
                continue
            first.append(min(turns))
            script = self.script(task)
            asked = f"{script.question}={script.answer}"
            written = " ".join(
                m for s in e.samples for m in _SUMMARY.findall("".join(t.text for t in s.turns if t.role == "policy"))
            )
            kept += asked in written.split()
            kept_value += any(f.partition("=")[2] == script.answer for f in written.split())
        out["summarised"] = round(len(first) / n, 4)
        out["policy_summaries"] = round(sum(e.counts.get("policy_summaries", 0) for e in episodes) / n, 4)
        if first:
            out["summary_turn"] = round(sum(first) / len(first), 3)
            out["kept_asked"] = round(kept / len(first), 4)
            out["kept_value"] = round(kept_value / len(first), 4)
        for k in range(self.options.turns + 1):
            out[f"summary_at_turn_{k}"] = round(first.count(k) / n, 4)
        return out

    def grade(self, task: TaskSpec, completion: str) -> Score:
        line = completion.partition(self.terminator)[0]
        if not line:
            return self.failure("no answer")
        correct = line == task.reference
        return Score.of(
            {"correct": 1.0 if correct else 0.0},
            correct=correct,
            parse_ok=True,
            reason="correct" if correct else f"wrong: expected {task.reference}, got {line[:16]!r}",
        )
