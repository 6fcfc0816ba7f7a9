"""Two small agentic environments for tests, not registered (the registry holds only real tasks).

They exercise what no registered environment does yet, so the invariant suite covers it:
`SummaryRestart` writes a summary and continues from prompt + summary in a new sample (a
Composer-style context edit, the summary's sampled ids copied, never re-encoded); `Swarm` hands a
sub-task to a frozen `arith` sub-agent and continues with its answer (a PARL-style nested agent).
"""

from __future__ import annotations

import random
from typing import ClassVar

import msgspec

from slipstream.envs import EpisodeContext, Outcome, Span, get_env
from slipstream.envs.base import Environment, Problem, Score, TaskSpec


class _Options(msgspec.Struct, frozen=True):
    pass


class _Words(Environment[_Options]):
    """Problems are 3-letter words; the answer is the word; `correct` only."""

    Options: ClassVar[type[msgspec.Struct]] = _Options
    components: ClassVar[tuple[str, ...]] = ("correct",)

    def sample(self, rng: random.Random) -> Problem:
        word = "".join(rng.choice("abcdef") for _ in range(3))
        return Problem(key=word, prompt=f"say {word}:", reference=word)

    def grade(self, task: TaskSpec, completion: str) -> Score:
        correct = completion.partition("\n")[0] == task.reference
        return Score.of({"correct": float(correct)}, correct=correct, parse_ok=True, reason="")


class SummaryRestart(_Words):
    """Draft, summarise, then answer from a fresh sample holding the prompt and the summary."""

    name: ClassVar[str] = "t-summary"

    async def run(self, ctx: EpisodeContext) -> Outcome:
        root = ctx.open(ctx.task.prompt)
        await ctx.generate(root, max_tokens=6)
        ctx.observe(root, "\nsummarise:")
        await ctx.generate(root, max_tokens=4)
        prompt_end = root.spans()[0][1]
        _, start, end, _ = root.spans()[-1]
        child = ctx.branch(root, [Span(0, prompt_end), "summary:", Span(start, end), "\n"], edit="summary")
        last = await ctx.generate(child, max_tokens=4)
        return Outcome(final_text=child.completion_text(), finish_reason=last.finish_reason)


class Swarm(_Words):
    """An orchestrator that asks a frozen arith sub-agent one question, then answers."""

    name: ClassVar[str] = "t-swarm"

    async def run(self, ctx: EpisodeContext) -> Outcome:
        root = ctx.open(ctx.task.prompt)
        await ctx.generate(root, max_tokens=4)
        arith = get_env("arith")
        sub_task = arith.generate("train", 1, seed=len(ctx.task.task_id))[0]
        sub = await ctx.spawn(arith, sub_task, agent_id="worker-0")
        ctx.observe(root, f"<sub>{sub.final_text.strip()}</sub>\n")
        last = await ctx.generate(root, max_tokens=4)
        return Outcome(final_text=last.text, finish_reason=last.finish_reason)


LOCAL_ENVS: dict[str, type[Environment[_Options]]] = {"t-summary": SummaryRestart, "t-swarm": Swarm}
