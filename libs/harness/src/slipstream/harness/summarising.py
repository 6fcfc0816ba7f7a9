"""`SummarisingContext`: the `EpisodeContext` that runs self-summarising chains over a recorder.

The environment keeps the `Thread` it opened (a `ChainThread`), which follows its chain to the
newest link; the rules (when to summarise, what a restarted context holds) are summary.py's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from slipstream.envs.context import Generation, Nested, Outcome, Purpose, Span
from slipstream.harness.episode import Recorder
from slipstream.harness.state import SampleBuilder
from slipstream.harness.summary import TRUNCATED, SummaryConfig, restart_text

if TYPE_CHECKING:
    from slipstream.envs.base import TaskSpec
    from slipstream.schemas import ToolEvent
    from slipstream.toolcalls import ToolRegistry, ToolTransport


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

    def ids(self) -> list[int]:
        return self.chain.current.ids()

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
    def purpose(self) -> Purpose:
        return self.inner.purpose

    @property
    def agent_id(self) -> str:
        return self.inner.agent_id

    def _unwrap(self, thread: Any) -> Any:
        return thread.chain.current if isinstance(thread, ChainThread) else thread

    def open(
        self, prompt: str, *, agent_id: str | None = None, role: str | None = None, trainable: bool | None = None
    ) -> ChainThread:
        return ChainThread(Chain(self.inner.open(prompt, agent_id=agent_id, role=role, trainable=trainable)))

    def open_ids(
        self, ids: list[int], *, agent_id: str | None = None, role: str | None = None, trainable: bool | None = None
    ) -> Any:
        # A client-rendered sample is the client's to keep: its prompts must extend what it holds,
        # so it is never summarised and restarted under it.
        return self.inner.open_ids(ids, agent_id=agent_id, role=role, trainable=trainable)

    def observe_ids(self, thread: Any, ids: list[int], *, role: str = "observation") -> None:
        self.inner.observe_ids(self._unwrap(thread), ids, role=role)

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
        self, env: Nested, task: TaskSpec, *, agent_id: str, role: str = "subagent", trainable: bool = False
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
