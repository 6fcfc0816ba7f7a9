"""What the agents of one episode write into: its samples as they are built, tool log, counts, timings.

Its own module because the recorder (episode.py), the merge of a pooled sub-agent's reply
(subagents.py) and the self-summarising context (summarising.py) all read and write it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slipstream.engine.tokenizer import Tokenizer
from slipstream.schemas import PolicySegment, Sample, ToolEvent, Turn, pack_floats, pack_ids, pack_mask


@dataclass
class SampleBuilder:
    """One sample being assembled; environments see it as a `Thread`."""

    sample_id: str
    agent_id: str
    role: str
    trainable: bool
    prompt: list[int]
    tokenizer: Tokenizer
    branch_of: str = ""
    branch_pos: int = 0
    edit: str = ""
    after: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    segments: list[list[int]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    finish_reason: str = ""
    calls: int = 0
    closed: bool = False
    # MoE engines: the routes of the sample's tokens as of its latest turn (which covers every earlier one).
    routes: bytes = b""
    routes_per_token: int = 0

    def __len__(self) -> int:
        return len(self.prompt) + len(self.after)

    def ids(self) -> list[int]:
        return [*self.prompt, *self.after]

    def completion_text(self) -> str:
        return self.tokenizer.decode([t for t in self.after if t != self.tokenizer.eos_id])

    def spans(self) -> list[tuple[str, int, int, str]]:
        return [(t.role, t.start, t.end, t.text) for t in self.turns]

    def last_version(self) -> int | None:
        return self.segments[-1][0] if self.segments else None

    def add_versions(self, runs: list[tuple[int, int]]) -> None:
        for version, n in runs:
            if n <= 0:
                continue
            if self.segments and self.segments[-1][0] == version:
                self.segments[-1][1] += n
            else:
                self.segments.append([version, n])

    def to_sample(self) -> Sample:
        return Sample(
            sample_id=self.sample_id,
            agent_id=self.agent_id,
            role=self.role,
            trainable=self.trainable,
            prompt_len=len(self.prompt),
            token_ids=pack_ids(self.ids()),
            logprobs=pack_floats(self.logprobs),
            loss_mask=pack_mask(self.mask),
            segments=[PolicySegment(v, n) for v, n in self.segments],
            turns=list(self.turns),
            branch_of=self.branch_of,
            branch_pos=self.branch_pos,
            edit=self.edit,
            finish_reason=self.finish_reason,
            routes=self.routes,
            routes_per_token=self.routes_per_token,
        )


@dataclass
class EpisodeState:
    """What every agent of one episode writes into: samples, tool log, counts, timings."""

    episode_id: str
    samples: list[SampleBuilder] = field(default_factory=list)
    tool_log: list[ToolEvent] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    rewards: dict[str, float] = field(default_factory=dict)
    calls: int = 0
    queued_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    generate_s: float = 0.0
    last_finish: str = ""

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n
