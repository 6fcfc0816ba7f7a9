"""Self-summarising chains (Composer 2): a long episode continues in a fresh context the model wrote.

When a sample's context reaches the group's threshold, the harness asks the policy for a summary
(an instruction appended as an observation, then `summary_tokens` of room to think and write),
and restarts the context from the task prompt, that summary, the conversation state (how many
summaries so far) and whatever arrived since the policy last spoke (a tool result, a question:
kept verbatim, as token slices of the old link, so it is never re-encoded). The restart is a
context edit: a new sample of the same episode (`edit="summary"`, `branch_of` the link before
it), so the chain's earlier links are never rewritten. The environment does not know: it keeps
the `Thread` it opened, which now continues in the newest link. Works for any multi-turn
environment written against `EpisodeContext`.

Credit needs nothing special, by design of libs/rl `credit.py`: the summary tokens are the
policy's own sampled tokens in the link they end, so the episode's outcome advantage reaches
every sampled token of every link, summaries included; with the default `"token"` sample
weighting a chain of N links trains each sampled token exactly once, so N is never an implicit
weight (`"episode"` weighting gives each link 1/N instead).

The threshold is drawn once per group (a hash of the group id into [min, max] tokens), so the
episodes that share a baseline face the same context budget and their rewards stay comparable.

`mode="truncate"` is the baseline summaries are measured against: at the same threshold the
context restarts from the task prompt, a marker and the last `summary_tokens` tokens of the
conversation (at least everything since the policy last spoke), verbatim, with no summary
written. Both modes carry the same budget across a restart; only what fills it differs.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from slipstream.envs.context import Generation, Outcome, Span

if TYPE_CHECKING:
    from slipstream.envs.base import Environment, TaskSpec
    from slipstream.harness.episode import Recorder, SampleBuilder
    from slipstream.schemas import ToolEvent
    from slipstream.tools import ToolRegistry, ToolTransport

Doc = msgspec.Meta

DEFAULT_REQUEST = (
    "\n[Context limit reached. Summarise your work so far for yourself: the facts you found that the "
    "answer needs, your plan, and what remains to do. End with </summary>.]\n<summary>"
)
DEFAULT_RESTART = "\n[Summary {n} of your earlier work]\n{summary}\n[Summaries so far: {n}]\n"
TRUNCATED = "\n[truncated]\n"
MODES = ("summary", "truncate")


class SummaryConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """When and how an episode summarises itself (`[rollout.summary]` in a run file)."""

    enabled: Annotated[bool, Doc(description="Summarise when a context reaches the threshold.")] = False
    mode: Annotated[
        Literal["summary", "truncate"],
        Doc(
            description="'summary': the policy writes a summary and the context restarts from it; 'truncate' "
            "(the baseline): the context restarts from the task and its last summary_tokens tokens, no summary."
        ),
    ] = "summary"
    min_tokens: Annotated[int, Doc(description="Lowest context threshold drawn for a group, in tokens.")] = 1024
    max_tokens: Annotated[int, Doc(description="Highest context threshold drawn for a group, in tokens.")] = 1024
    summary_tokens: Annotated[int, Doc(description="Room the policy gets to write one summary, in tokens.")] = 256
    max_summaries: Annotated[
        int, Doc(description="Summaries per episode; past it the context just grows (and may end the episode).")
    ] = 8
    request: Annotated[str, Doc(description="The instruction appended (as an observation) to ask for a summary.")] = (
        DEFAULT_REQUEST
    )
    stop: Annotated[tuple[str, ...], Doc(description="Stop strings that end a summary.")] = ("</summary>",)
    restart_template: Annotated[
        str,
        Doc(
            description="What follows the task prompt in a restarted context; {summary} is the summary and {n} "
            "the number of summaries so far (the conversation state)."
        ),
    ] = DEFAULT_RESTART

    def __post_init__(self) -> None:
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {self.min_tokens} and {self.max_tokens}")
        if self.summary_tokens < 1 or self.max_summaries < 1:
            raise ValueError(
                f"summary_tokens and max_summaries must be >= 1, got {self.summary_tokens} and {self.max_summaries}"
            )
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.request.strip():
            raise ValueError("request must not be empty: the policy has to be asked for its summary")
        if "{summary}" not in self.restart_template or "{n}" not in self.restart_template:
            raise ValueError(
                f"restart_template must hold {{summary}} and {{n}} (the summary and the state), got "
                f"{self.restart_template!r}"
            )


def group_threshold(config: SummaryConfig, group_id: str) -> int:
    """The context threshold of every episode of group `group_id`: a hash of the id into [min, max]."""
    span = config.max_tokens - config.min_tokens + 1
    digest = hashlib.blake2b(f"summary-threshold:{group_id}".encode(), digest_size=8).digest()
    return config.min_tokens + int.from_bytes(digest, "little") % span


def restart_text(summary: str, summaries: int, template: str = DEFAULT_RESTART) -> str:
    """What follows the task prompt in a restarted context: the summary and the conversation state."""
    return template.replace("{summary}", summary.strip()).replace("{n}", str(summaries))


class Chain:
    """The links of one summarised conversation; `current` is where it continues."""

    def __init__(self, root: SampleBuilder) -> None:
        self.current = root
        self.task_len = len(root.prompt)  # [bos] + the task prompt, kept verbatim in every restart
        self.summaries = 0


class ChainThread:
    """The `Thread` an environment holds: it follows its chain to the newest link."""

    def __init__(self, chain: Chain) -> None:
        self.chain = chain

    @property
    def sample_id(self) -> str:
        return self.chain.current.sample_id

    @property
    def agent_id(self) -> str:
        return self.chain.current.agent_id

    def __len__(self) -> int:
        return len(self.chain.current)

    def completion_text(self) -> str:
        return self.chain.current.completion_text()

    def spans(self) -> list[tuple[str, int, int, str]]:
        return self.chain.current.spans()

    def __repr__(self) -> str:
        return f"ChainThread({self.sample_id}, {self.chain.summaries} summaries)"


class SummarisingContext:
    """An `EpisodeContext` that summarises and restarts a thread's context past the threshold."""

    def __init__(self, inner: Recorder, config: SummaryConfig, threshold: int) -> None:
        limit = inner.run.max_seq_len
        if limit is not None and threshold + config.summary_tokens + 64 > limit:
            raise ValueError(
                f"summary threshold {threshold} + summary_tokens {config.summary_tokens} does not fit the engine's "
                f"context of {limit} tokens (leave room for the request and the summary)"
            )
        self.inner = inner
        self.config = config
        self.threshold = threshold

    @property
    def task(self) -> TaskSpec:
        return self.inner.task

    @property
    def agent_id(self) -> str:
        return self.inner.agent_id

    def _unwrap(self, thread: Any) -> Any:
        return thread.chain.current if isinstance(thread, ChainThread) else thread

    def open(
        self, prompt: str, *, agent_id: str | None = None, role: str | None = None, trainable: bool | None = None
    ) -> ChainThread:
        return ChainThread(Chain(self.inner.open(prompt, agent_id=agent_id, role=role, trainable=trainable)))

    async def generate(
        self, thread: Any, *, max_tokens: int | None = None, stop: list[str] | None = None
    ) -> Generation:
        if isinstance(thread, ChainThread):
            chain = thread.chain
            if len(chain.current) >= self.threshold and chain.summaries < self.config.max_summaries:
                await self._summarise(chain)
        return await self.inner.generate(self._unwrap(thread), max_tokens=max_tokens, stop=stop)

    async def _summarise(self, chain: Chain) -> None:
        link = chain.current
        # What arrived since the policy last spoke (a tool result, a question) is still waiting for
        # an answer: it goes into the restart verbatim, after the summary.
        policy_ends = [t.end for t in link.turns if t.role == "policy"]
        pending = Span(policy_ends[-1] if policy_ends else len(link.prompt), len(link))
        if self.config.mode == "truncate":
            self._truncate(chain, pending)
            return
        self.inner.observe(link, self.config.request, role="summary_request")
        written = await self.inner.generate(link, max_tokens=self.config.summary_tokens, stop=list(self.config.stop))
        chain.summaries += 1
        summary = written.text
        for end in self.config.stop:  # the engine keeps the stop string it stopped at
            if summary.endswith(end):
                summary = summary[: -len(end)]
                break
        restart: list[Span | str] = [
            Span(0, chain.task_len),
            restart_text(summary, chain.summaries, self.config.restart_template),
        ]
        if pending.end > pending.start:
            restart.append(pending)
        chain.current = self.inner.branch(link, restart, edit="summary", finish_reason="summary")
        self.inner.count("summaries")
        self.inner.count("summary_tokens_before", len(link))
        self.inner.count("summary_tokens_after", len(chain.current))

    def _truncate(self, chain: Chain, pending: Span) -> None:
        """The baseline: keep the task prompt and the conversation's last tokens, drop the rest unread."""
        link = chain.current
        start = max(chain.task_len, min(pending.start, len(link) - self.config.summary_tokens))
        chain.summaries += 1  # restarts so far (the chain's state), whichever mode made them
        restart: list[Span | str] = [Span(0, chain.task_len), TRUNCATED]
        if len(link) > start:
            restart.append(Span(start, len(link)))
        chain.current = self.inner.branch(link, restart, edit="truncate", finish_reason="truncate")
        self.inner.count("truncations")
        self.inner.count("summary_tokens_before", len(link))
        self.inner.count("summary_tokens_after", len(chain.current))

    def observe(self, thread: Any, text: str, *, role: str = "observation") -> None:
        self.inner.observe(self._unwrap(thread), text, role=role)

    def branch(self, parent: Any, pieces: list[Span | str], *, edit: str, finish_reason: str = "edit") -> Any:
        new = self.inner.branch(self._unwrap(parent), pieces, edit=edit, finish_reason=finish_reason)
        if isinstance(parent, ChainThread):
            parent.chain.current = new  # an environment's own edit (a prune) continues the same chain
            return parent
        return new

    async def spawn(
        self, env: Environment[Any], task: TaskSpec, *, agent_id: str, role: str = "subagent", trainable: bool = False
    ) -> Outcome:
        return await self.inner.spawn(env, task, agent_id=agent_id, role=role, trainable=trainable)

    def tools(self, registry: ToolRegistry) -> ToolTransport:
        return self.inner.tools(registry)

    def log_tool(self, event: ToolEvent) -> None:
        self.inner.log_tool(event)

    def count(self, name: str, n: int = 1) -> None:
        self.inner.count(name, n)

    def reward(self, name: str, value: float) -> None:
        self.inner.reward(name, value)
