"""Critical steps: the swarm's cost in time, as K2.5's Agent Swarm (PARL) measures it.

Each orchestrator turn is a stage. Its direct tool calls (search, grep, read) run one after the
other, so they cost one step each, and a turn costs at least 1 (a turn with no call is the final
message): S_main(t) = max(1, direct calls in turn t). The assign_task calls of one turn are one
parallel cohort; they cost what the longest sub-agent took, max_i S_sub,i(t), where a sub-agent's
steps are its tool invocations plus 1 for each turn without a call (its final message), as the
child reports them (`Outcome.steps`). create_subagent costs nothing beyond the turn's 1.

    CriticalSteps = sum_t (S_main(t) + max_i S_sub,i(t))      (an empty cohort counts 0)
    TotalSteps    = sum_t (S_main(t) + sum_i S_sub,i(t))

A serial episode (no sub-agents) has CriticalSteps == TotalSteps; a parallel one saves the sum
of each cohort's non-longest members. The evaluation and training limit is on critical steps
(`max_critical_steps`): see env.py for where it cuts an episode.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Stage:
    """One orchestrator turn: its direct calls and the steps of each sub-agent it ran."""

    direct: int
    subagents: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.direct < 0 or any(s < 0 for s in self.subagents):
            raise ValueError(f"step counts must be >= 0, got direct={self.direct}, subagents={self.subagents}")

    @property
    def main(self) -> int:
        """S_main(t) = max(1, direct calls)."""
        return max(1, self.direct)

    @property
    def critical(self) -> int:
        return self.main + max(self.subagents, default=0)

    @property
    def total(self) -> int:
        return self.main + sum(self.subagents)


@dataclass
class Ledger:
    """The stages of one episode so far, with their critical and total steps."""

    stages: list[Stage] = field(default_factory=list)

    def add(self, direct: int, subagents: tuple[int, ...] | list[int] = ()) -> Stage:
        stage = Stage(direct=direct, subagents=tuple(subagents))
        self.stages.append(stage)
        return stage

    @property
    def critical(self) -> int:
        return sum(s.critical for s in self.stages)

    @property
    def total(self) -> int:
        return sum(s.total for s in self.stages)


def critical_steps(stages: list[Stage]) -> int:
    """sum_t (S_main(t) + max_i S_sub,i(t))."""
    return sum(s.critical for s in stages)


def total_steps(stages: list[Stage]) -> int:
    """sum_t (S_main(t) + sum_i S_sub,i(t))."""
    return sum(s.total for s in stages)
