"""`lookup`: a multi-turn tool-use task a tiny byte-level model learns on a CPU.

The prompt names a key ("key qx?\\n"); its value is a 3-digit number drawn from a hash of the
key, so no model can know it: the policy has to call the `get` tool with the right key, read the
result and answer with it. One episode, with the plain-text tag protocol of libs/toolcalls:

    [bos]key qx?\\n                                      prompt
    <tool>{"name": "get", "args": {"key": "qx"}}</tool>  sampled (generation stops at </tool>)
    <result>417</result>\\n                              observation (tokenised, mask 0)
    417\\n                                               sampled: the answer (stops at "\\n")

A turn without a tool call is the answer and ends the episode; a turn with calls beyond
`max_calls` ends it unanswered (finish reason `max_calls`). A malformed call (bad tags, bad
JSON, unknown tool, wrong arguments) is shown to the model as the parser's error text, logged
with status `invalid_tool_call`, counted on the episode (`counts["invalid_tool_call"]`), and the
model may try again, up to `max_calls` calls in all.

Scoring (`grade_episode`, components sum to the reward):
- `correct`: `correct_reward` (1.0) when the answer line is exactly the key's value.
- `invalid_call`: `-invalid_call_penalty` (0.2) per invalid call (0 when the penalty is 0).
The text-only `grade(task, completion)` judges the answer alone (`invalid_call` = 0).

Splits: by key (the base class's hash), so held-out keys, and therefore their values, are never
seen in training: held-out success measures tool use, not memory. `expert` is the scripted
policy whose episodes warm-start the model (`sft_warmstart` uses them: `warmstart_from_expert`).
By default it is perfect; `expert_guess_rate` and `expert_slip_rate` make it an imperfect teacher
(it guesses without the tool on some keys, makes a malformed first call on others), whose habits a
warm-started model copies and RL has to unlearn: that is what `slipstream demo --env lookup` does.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
import string
from typing import Annotated, ClassVar

import msgspec

from slipstream.envs.base import Environment, Problem, Score, TaskSpec, fixed_draw
from slipstream.envs.context import EpisodeContext, Outcome
from slipstream.envs.registry import register
from slipstream.schemas import Episode
from slipstream.toolcalls import Tool, ToolCall, ToolRegistry, execute, renderer_for, tool_event

Doc = msgspec.Meta

TOOL_NAME = "get"
_KEY_CHARS = string.digits + string.ascii_lowercase
_RESULT = re.compile(r"<result>(.*?)</result>", re.DOTALL)
_KEY = re.compile(r"key ([^?\n]*)\?")


class LookupOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Options of `lookup`; `get_env("lookup", invalid_call_penalty=0.5)`."""

    min_len: Annotated[int, Doc(description="Shortest key.")] = 3
    max_len: Annotated[int, Doc(description="Longest key.")] = 3
    alphabet: Annotated[str, Doc(description="Characters keys are drawn from (digits or lowercase letters).")] = (
        string.digits
    )
    max_calls: Annotated[int, Doc(description="Tool calls allowed per episode (an invalid one counts).")] = 2
    max_turn_tokens: Annotated[int, Doc(description="Most tokens one model turn may sample.")] = 64
    correct_reward: Annotated[float, Doc(description="Reward component for the right answer.")] = 1.0
    invalid_call_penalty: Annotated[
        float, Doc(description="Subtracted per invalid tool call (reward component 'invalid_call').")
    ] = 0.2
    salt: Annotated[str, Doc(description="Mixed into the value hash: a different table per salt.")] = "slipstream"
    expert_guess_rate: Annotated[
        float,
        Doc(description="Fraction of keys on which the scripted expert guesses (wrongly) without calling the tool."),
    ] = 0.0
    expert_slip_rate: Annotated[
        float,
        Doc(
            description="Fraction of the other keys on which the expert's first call is malformed (the key as a "
            "bare JSON value), then corrected."
        ),
    ] = 0.0
    tool_latency_ms: Annotated[
        int, Doc(description="Simulated backend latency of `get` in ms (load and fail-over tests); 0 answers at once.")
    ] = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len <= 16:
            raise ValueError(f"need 1 <= min_len <= max_len <= 16, got min_len={self.min_len}, max_len={self.max_len}")
        if not self.alphabet or not all(c in _KEY_CHARS for c in self.alphabet):
            raise ValueError(f"alphabet must be ASCII digits or lowercase letters, got {self.alphabet!r}")
        if len(set(self.alphabet)) != len(self.alphabet):
            raise ValueError(f"alphabet has repeated letters: {self.alphabet!r}")
        if not 1 <= self.max_calls <= 16:
            raise ValueError(f"max_calls must be in 1..16, got {self.max_calls}")
        if not 16 <= self.max_turn_tokens <= 1024:
            raise ValueError(f"max_turn_tokens must be in 16..1024, got {self.max_turn_tokens}")
        if not 0 <= self.tool_latency_ms <= 1000:
            raise ValueError(f"tool_latency_ms must be in 0..1000, got {self.tool_latency_ms}")
        for name, rate in (("expert_guess_rate", self.expert_guess_rate), ("expert_slip_rate", self.expert_slip_rate)):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {rate}")
        if not self.correct_reward > 0 or self.invalid_call_penalty < 0:
            raise ValueError(
                f"need correct_reward > 0 and invalid_call_penalty >= 0, got {self.correct_reward} "
                f"and {self.invalid_call_penalty}"
            )


@register("lookup")
class Lookup(Environment[LookupOptions]):
    """Multi-turn: call `get` with the prompt's key, then answer with the value it returns."""

    version: ClassVar[str] = "1"
    Options: ClassVar[type[msgspec.Struct]] = LookupOptions
    components: ClassVar[tuple[str, ...]] = ("correct", "invalid_call")
    warmstart_from_expert: ClassVar[bool] = True

    def __init__(self, options: LookupOptions | None = None) -> None:
        super().__init__(options)
        self.renderer = renderer_for("tags")
        self.registry = ToolRegistry([self._tool()])

    @property
    def max_completion_chars(self) -> int:
        return self.options.max_turn_tokens

    def value(self, key: str) -> str:
        """The value stored under `key`: 3 digits from a hash of (salt, key), 100..999."""
        digest = hashlib.blake2b(f"{self.options.salt}:{key}".encode(), digest_size=8).digest()
        return str(100 + int.from_bytes(digest, "little") % 900)

    def _tool(self) -> Tool:
        letters = re.escape(self.options.alphabet)

        latency_s = self.options.tool_latency_ms / 1000

        async def get(key: str) -> str:
            if latency_s:
                await asyncio.sleep(latency_s)
            return self.value(key)

        return Tool(
            name=TOOL_NAME,
            description="The value stored under a key.",
            parameters={
                "type": "object",
                "properties": {"key": {"type": "string", "pattern": f"^[{letters}]{{1,16}}$"}},
                "required": ["key"],
                "additionalProperties": False,
            },
            fn=get,
            timeout_s=2.0,
        )

    # -- tasks ----------------------------------------------------------------------------------

    def sample(self, rng: random.Random) -> Problem:
        length = rng.randint(self.options.min_len, self.options.max_len)
        key = "".join(rng.choice(self.options.alphabet) for _ in range(length))
        return Problem(key=key, prompt=f"key {key}?\n", reference=self.value(key))

    def call_text(self, key: str) -> str:
        """The well-formed call for `key`, exactly as the tag renderer writes it."""
        return self.renderer.render_calls("", [ToolCall(id="expert", name=TOOL_NAME, arguments={"key": key})])

    def _draw(self, key: str, what: str) -> float:
        """A fixed number in [0, 1) per (salt, what, key): the expert's choices are a function of the key."""
        return fixed_draw(f"{self.options.salt}:{what}:{key}")

    def expert(self, task: TaskSpec, context: str) -> str:
        """The scripted expert: call `get` with the key, then answer with the last result.

        With `expert_guess_rate` / `expert_slip_rate` it is an imperfect teacher, as a stronger
        model's trajectories are: on a fixed fraction of keys it answers a wrong guess without
        looking, and on a fixed fraction of the rest its first call is malformed (the key as a bare
        JSON value: a schema error, or bad JSON for letters), then it reads the error and calls
        again correctly. A warm-started model copies those habits; RL has to unlearn them.
        """
        match = _KEY.search(context)
        key = match.group(1) if match else ""
        results = _RESULT.findall(context)
        if self._draw(key, "guess") < self.options.expert_guess_rate:
            value = int(self.value(key))
            return str(100 + (value - 100 + 1 + int(self._draw(key, "value") * 898)) % 900) + self.terminator
        if not results:
            call = self.call_text(key)
            if self._draw(key, "slip") < self.options.expert_slip_rate:
                return call.replace(f'"key": "{key}"', f'"key": {key}', 1)
            return call
        if results[-1].startswith("error"):
            return self.call_text(key)
        return results[-1] + self.terminator

    def sft_example(self, task: TaskSpec) -> str:
        return task.reference + self.terminator

    # -- the episode ------------------------------------------------------------------------------

    async def run(self, ctx: EpisodeContext) -> Outcome:
        thread = ctx.open(ctx.task.prompt)
        transport = ctx.tools(self.registry)
        stops = [*self.renderer.stop_strings, self.terminator]
        calls = 0
        while True:
            gen = await ctx.generate(thread, max_tokens=self.options.max_turn_tokens, stop=stops)
            turn = self.renderer.parse(gen.text, self.registry, call_id_prefix=f"{thread.sample_id}-t{gen.turn}")
            if not turn.items:
                return Outcome(final_text=gen.text, finish_reason=gen.finish_reason)
            if calls + len(turn.items) > self.options.max_calls:
                ctx.count("over_call_budget")
                return Outcome(final_text="", finish_reason="max_calls")
            results = await execute(turn.items, transport)
            for item, result in zip(turn.items, results, strict=True):
                ctx.log_tool(tool_event(item, result, sample_id=thread.sample_id, turn=gen.turn))
            calls += len(results)
            ctx.observe(thread, self.renderer.render(self.renderer.result_messages(results)))

    # -- scoring ------------------------------------------------------------------------------------

    def grade_episode(self, task: TaskSpec, episode: Episode) -> Score:
        answer = self.grade(task, episode.final_text)
        invalid = episode.counts.get("invalid_tool_call", 0)
        penalty = -self.options.invalid_call_penalty * invalid if invalid else 0.0
        reason = answer.reason + (f"; {invalid} invalid tool call(s)" if invalid else "")
        return Score.of(
            {"correct": answer.components["correct"], "invalid_call": penalty},
            correct=answer.correct,
            parse_ok=answer.parse_ok,
            reason=reason,
        )

    def grade(self, task: TaskSpec, completion: str) -> Score:
        line = completion.partition(self.terminator)[0]
        if not line:
            return self.failure("no answer (empty final turn, or the episode ran out of calls)")
        correct = line == task.reference
        return Score.of(
            {"correct": self.options.correct_reward if correct else 0.0, "invalid_call": 0.0},
            correct=correct,
            parse_ok=True,
            reason="correct" if correct else f"wrong: expected {task.reference}, got {line[:32]!r}",
        )
