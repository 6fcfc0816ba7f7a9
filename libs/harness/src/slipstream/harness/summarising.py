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
        self.turns = 0  # the environment's generate calls so far (a summary's own calls not counted)
        self.summary: str | None = None  # the latest summary, which a truncation keeps (policy summaries)
        self.body_start = self.task_len  # where the current link's conversation starts, after its header


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
        if not isinstance(thread, ChainThread):
            return await self.inner.generate(thread, max_tokens=max_tokens, stop=stop)
        chain = thread.chain
        if len(chain.current) >= self.threshold and chain.summaries < self.config.max_summaries:
            self.inner.count(f"threshold_at_turn_{chain.turns}")
            await self._summarise(chain)
        link = chain.current
        if not self.config.policy:
            chain.turns += 1
            return await self.inner.generate(link, max_tokens=max_tokens, stop=stop)
        pending = self._pending(link)
        opened_at = len(link)
        gen = await self.inner.generate(link, max_tokens=max_tokens, stop=stop)
        if not (chain.summaries < self.config.max_summaries and self._opens(gen)):
            chain.turns += 1
            return gen
        # The policy chose to summarise now: let it finish, restart from its summary, and ask the
        # environment's turn again in the new link (the pending line follows the summary there).
        text = gen.text
        if not any(text.endswith(end) for end in self.config.stop):
            more = await self.inner.generate(link, max_tokens=self.config.summary_tokens, stop=list(self.config.stop))
            text += more.text
        body = text[len(self.config.open) :] if text.startswith(self.config.open) else ""
        self._unlearn(link, opened_at)
        self.inner.count("policy_summaries")
        self.inner.count(f"summary_at_turn_{chain.turns}")
        self.inner.count("summary_context_tokens", opened_at)
        self._restart(chain, self._cut(body), pending)
        return await self.generate(thread, max_tokens=max_tokens, stop=stop)

    def _opens(self, gen: Generation) -> bool:
        """The turn opens a summary: it begins with `open`, or stopped for length inside it."""
        opener = self.config.open
        return gen.text.startswith(opener) or (
            gen.finish_reason == "length" and bool(gen.text) and opener.startswith(gen.text)
        )

    def _cut(self, summary: str) -> str:
        """The summary without what ends it: up to the first stop string (the engine keeps the one it stopped at)."""
        ends = [summary.find(end) for end in self.config.stop if end in summary]
        return summary[: min(ends)] if ends else summary

    @staticmethod
    def _pending(link: Any) -> Span:
        """What arrived since the policy last spoke (a tool result, a question): still waiting for an answer."""
        policy_ends = [t.end for t in link.turns if t.role == "policy"]
        return Span(policy_ends[-1] if policy_ends else len(link.prompt), len(link))

    def _unlearn(self, link: Any, start: int) -> None:
        """The control `train_summaries=False`: the summary's tokens (from `start` on) get loss mask 0 in training."""
        if self.config.train_summaries or self.inner.purpose != "train":
            return
        offset = len(link.prompt)
        for i in range(max(0, start - offset), len(link.mask)):
            link.mask[i] = 0

    async def _summarise(self, chain: Chain) -> None:
        link = chain.current
        pending = self._pending(link)
        if self.config.mode == "truncate":
            self._truncate(chain, pending)
            return
        self.inner.observe(link, self.config.request, role="summary_request")
        opened_at = len(link)
        written = await self.inner.generate(link, max_tokens=self.config.summary_tokens, stop=list(self.config.stop))
        self._unlearn(link, opened_at)
        self._restart(chain, self._cut(written.text), pending)

    def _restart(self, chain: Chain, summary: str, pending: Span) -> None:
        """Continue the chain in a new link: the task prompt, the summary with the state, the pending line."""
        link = chain.current
        chain.summaries += 1
        restart: list[Span | str] = [
            Span(0, chain.task_len),
            restart_text(summary, chain.summaries, self.config.restart_template),
        ]
        if pending.end > pending.start:
            restart.append(pending)
        chain.current = self.inner.branch(link, restart, edit="summary", finish_reason="summary")
        chain.summary = summary
        chain.body_start = len(chain.current) - (pending.end - pending.start)
        self.inner.count("summaries")
        self.inner.count("summary_tokens_before", len(link))
        self.inner.count("summary_tokens_after", len(chain.current))

    def _truncate(self, chain: Chain, pending: Span) -> None:
        """The baseline: keep the task prompt and the conversation's last tokens, drop the rest unread.

        A summary the policy wrote earlier in the chain is kept too (it is the context the policy
        chose to carry), so a policy summary is lost only to a later one."""
        link = chain.current
        start = max(chain.body_start, min(pending.start, len(link) - self.config.summary_tokens))
        chain.summaries += 1  # restarts so far (the chain's state), whichever mode made them
        restart: list[Span | str] = [Span(0, chain.task_len)]
        if chain.summary is not None:
            restart.append(restart_text(chain.summary, chain.summaries, self.config.restart_template))
        restart.append(TRUNCATED)
        kept = max(0, len(link) - start)
        if kept:
            restart.append(Span(start, len(link)))
        chain.current = self.inner.branch(link, restart, edit="truncate", finish_reason="truncate")
        chain.body_start = len(chain.current) - kept
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
