"""The episode context: the handle an environment's own episode loop holds.

An environment plays a whole episode in `Environment.run(ctx)` (see base.py). It rarely touches
token ids itself: every id in an episode comes from the engine (sampled by `generate`), from the
tokenizer applied to text the environment hands to `open`, `observe` or `branch`, or, for an
environment whose client renders its own prompts, from that client (`open_ids`, `observe_ids`). The
harness (libs/harness) implements this protocol, records every engine call and assembles the
wire `Episode` (samples, tool log, counts) from what the loop did:

- `open(prompt)` starts a root sample for an agent: [bos] + encode(prompt).
- `generate(thread)` asks the policy to continue a sample; the sampled ids are appended with
  loss mask 1, their behaviour log-probs and the policy versions that produced them.
- `observe(thread, text)` appends encode(text) with loss mask 0 (a tool result, a budget line).
- `open_ids(ids)` / `observe_ids(thread, ids)` are the same with ids a client rendered itself (a
  verifiers harness renders its own prompts): the ids are kept exactly, nothing is re-encoded.
- `branch(parent, pieces, edit=...)` is a context edit (prune, summary restart, hand-off): a new
  sample whose prompt is made of slices of the parent's ids (`Span`) and new text, naming the
  parent and the position up to which it shares the parent's prefix. The parent is never
  rewritten.
- `spawn(env, task, ...)` runs another environment's episode (a nested agent) inside this one;
  its samples join this episode under their own agent id, frozen unless said otherwise.
- `tools(registry)` is where the episode's tool calls run: in this process by default, a
  tool-service over NATS when the worker is configured so (`[tools] transport = "nats"`); the
  results are classified the same either way.
- `log_tool` / `count` record the environment's log for scorers; `reward` adds a named reward
  component known only during play (it is summed with the scorer's components).
- `purpose` says why the episode is played: "train" (a rollout the learner may train on, or a
  teacher's episode for the warm-start) or "eval" (an evaluation, whatever the task's split). An
  environment that helps only while training (the search harness's soft budget message) reads it,
  never the task's split: a train-split task is also evaluated.

`ContextFull` is raised when a sample would outgrow the engine's context; an environment may
catch it (and, say, summarise) or let it end the episode with finish_reason "length".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal, Protocol, runtime_checkable

import msgspec

from slipstream.envs.task import TaskSpec
from slipstream.schemas import ToolEvent

if TYPE_CHECKING:
    from slipstream.toolcalls import ToolRegistry, ToolTransport

Doc = msgspec.Meta

Purpose = Literal["train", "eval"]
PURPOSES: tuple[Purpose, ...] = ("train", "eval")


class ContextFull(Exception):
    """A sample would not fit the engine's context window; `needed` and `limit` are token counts."""

    def __init__(self, sample_id: str, needed: int, limit: int) -> None:
        super().__init__(f"sample {sample_id!r} would need {needed} tokens; the engine's context holds {limit}")
        self.sample_id = sample_id
        self.needed = needed
        self.limit = limit


class Span(msgspec.Struct, frozen=True):
    """Token positions [start, end) of a parent sample, kept verbatim in a branch."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"Span needs 0 <= start <= end, got [{self.start}, {self.end})")


class Generation(msgspec.Struct, kw_only=True, frozen=True):
    """One engine call's output as the environment sees it."""

    text: Annotated[str, Doc(description="Decoded sampled tokens (specials such as eos dropped).")]
    n_tokens: Annotated[int, Doc(description="Tokens sampled (appended to the sample with loss mask 1).")]
    finish_reason: Annotated[str, Doc(description="'stop' (eos or a stop string) or 'length'.")]
    turn: Annotated[int, Doc(description="Index of this engine call within the episode.")]
    ids: Annotated[list[int], Doc(description="The sampled token ids, exactly as the engine produced them.")] = []
    logprobs: Annotated[list[float], Doc(description="Their behaviour log-probs, one per id.")] = []


class Outcome(msgspec.Struct, kw_only=True):
    """What an episode loop returns: the final answer and why it ended."""

    final_text: Annotated[str, Doc(description="The answer a scorer reads (Episode.final_text).")] = ""
    finish_reason: Annotated[str, Doc(description="Why the episode ended: 'stop', 'length', 'max_turns', ...")] = ""
    steps: Annotated[
        int,
        Doc(
            description="Steps the agent took: tool invocations, plus 1 for each turn without a call (its final "
            "message); 0 when the environment does not count them. A parent reads a spawned agent's cost here "
            "(the swarm's critical steps), wherever the child ran."
        ),
    ] = 0


@runtime_checkable
class Thread(Protocol):
    """A sample being built (opaque to environments beyond these read-only views)."""

    @property
    def sample_id(self) -> str: ...

    @property
    def agent_id(self) -> str: ...

    def __len__(self) -> int:
        """Tokens in the sample so far (prompt included): the position a `Span` indexes."""
        ...

    def ids(self) -> list[int]:
        """The sample's token ids so far, prompt included."""
        ...

    def completion_text(self) -> str:
        """Everything after the prompt, decoded (sampled and observation tokens, specials dropped)."""
        ...

    def spans(self) -> list[tuple[str, int, int, str]]:
        """(role, start, end, text) of every turn so far: 'policy' turns and observations."""
        ...


class Nested(Protocol):
    """What `EpisodeContext.spawn` plays as a nested agent: an environment (a `base.Environment` is one).

    Declared here because an environment's `run` takes an `EpisodeContext`: the two would
    otherwise import each other. A pooled child is rebuilt from `name` and `options`.
    """

    @property
    def name(self) -> str: ...

    @property
    def options(self) -> msgspec.Struct: ...

    async def run(self, ctx: EpisodeContext) -> Outcome: ...


@runtime_checkable
class EpisodeContext(Protocol):
    """What an environment's `run` may do; the harness implements it (libs/harness/episode.py)."""

    @property
    def task(self) -> TaskSpec: ...

    @property
    def purpose(self) -> Purpose:
        """Why the episode is played: "train" (a training rollout or a teacher's episode) or "eval"."""
        ...

    def open(
        self, prompt: str, *, agent_id: str | None = None, role: str | None = None, trainable: bool | None = None
    ) -> Thread:
        """A new root sample: [bos] + encode(prompt); agent tags default to this context's agent."""
        ...

    def open_ids(
        self, ids: list[int], *, agent_id: str | None = None, role: str | None = None, trainable: bool | None = None
    ) -> Thread:
        """A new root sample whose prompt is exactly `ids`: for a client that renders its own prompts
        (a verifiers harness through the generate route); no bos or template is added."""
        ...

    async def generate(
        self, thread: Thread, *, max_tokens: int | None = None, stop: list[str] | None = None
    ) -> Generation:
        """Sample a continuation of `thread` (the run's sampling params, narrowed by these)."""
        ...

    def observe(self, thread: Thread, text: str, *, role: str = "observation") -> None:
        """Append encode(text) to `thread` with loss mask 0; ContextFull if it would not fit."""
        ...

    def observe_ids(self, thread: Thread, ids: list[int], *, role: str = "observation") -> None:
        """Append exactly `ids` to `thread` with loss mask 0 (a client-rendered tool result or turn)."""
        ...

    def branch(self, parent: Thread, pieces: list[Span | str], *, edit: str, finish_reason: str = "edit") -> Thread:
        """A context edit: a new sample whose prompt is `pieces` (parent slices and new text)."""
        ...

    async def spawn(
        self,
        env: Nested,
        task: TaskSpec,
        *,
        agent_id: str,
        role: str = "subagent",
        trainable: bool = False,
    ) -> Outcome:
        """Run `env`'s episode on `task` as a nested agent; its samples join this episode."""
        ...

    def tools(self, registry: ToolRegistry) -> ToolTransport:
        """Where calls of `registry`'s tools run for this episode (in-process unless configured otherwise)."""
        ...

    def log_tool(self, event: ToolEvent) -> None:
        """Record a tool call for the scorer (also counts 'tool_calls' and one count per status)."""
        ...

    def count(self, name: str, n: int = 1) -> None:
        """Add `n` to the episode's event count `name`."""
        ...

    def reward(self, name: str, value: float) -> None:
        """A named reward component known during play, added to the scorer's components."""
        ...
