"""Critical steps: the swarm's cost in time, as K2.5's Agent Swarm (PARL) measures it.

PARL's definition (techniques.md §2.3, "S_main usually 1"): each orchestrator turn t is a stage of

    CriticalSteps = sum_t (S_main(t) + max_i S_sub,i(t))

where S_main(t) is the orchestrator's own step in turn t and S_sub,i(t) the steps of the i-th
sub-agent that turn runs. Here S_main(t) = 1 for every turn, whatever it calls: the direct tool
calls of one turn (search, grep, read) are issued together and run at once
(`slipstream.toolcalls.execution.execute` gathers them with `asyncio.gather`), so the turn waits for
them once, not once a call; a turn with no call (the final message) is a step too. A malformed
call (the parser's error: unknown tool, bad arguments, bad JSON) never runs, but the turn that
made it still costs its step, and the episode counts it (`malformed_calls`). The assign_task calls
of one turn are one parallel cohort; they add what the longest sub-agent took, max_i S_sub,i(t),
where a sub-agent's steps are its tool invocations plus 1 for each turn without a call (its final
message), as the child reports them (`Outcome.steps`). create_subagent costs nothing beyond the
turn's 1.

    CriticalSteps = sum_t (1 + max_i S_sub,i(t))            (an empty cohort counts 0)
    TotalSteps    = sum_t (max(1, ran_t) + sum_i S_sub,i(t))

TotalSteps is work, not time: `ran_t` counts the direct calls of turn t that ran (malformed
ones did not). An episode with at most one direct call a turn and no sub-agents has CriticalSteps
== TotalSteps; concurrency (several calls in a turn, a cohort of sub-agents) saves the rest.

Before issue 32 a turn cost max(1, direct calls), malformed ones included: concurrent direct
calls were charged as if serial. The swarm figures measured before then (libs/envs README) are
under that accounting. The evaluation and training limit is on critical steps
(`max_critical_steps`): see env.py for where it cuts an episode.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Stage:
    """One orchestrator turn: the direct calls that ran, the malformed ones, each sub-agent's steps."""

    direct: int
    subagents: tuple[int, ...] = ()
    malformed: int = 0

    def __post_init__(self) -> None:
        if self.direct < 0 or self.malformed < 0 or any(s < 0 for s in self.subagents):
            raise ValueError(
                f"step counts must be >= 0, got direct={self.direct}, malformed={self.malformed}, "
                f"subagents={self.subagents}"
            )

    @property
    def main(self) -> int:
        """S_main(t) = 1: the turn's calls run together (see the module docstring)."""
        return 1

    @property
    def critical(self) -> int:
        return self.main + max(self.subagents, default=0)

    @property
    def total(self) -> int:
        return max(1, self.direct) + sum(self.subagents)


@dataclass
class Ledger:
    """The stages of one episode so far, with their critical and total steps."""

    stages: list[Stage] = field(default_factory=list)

    def add(self, direct: int, subagents: tuple[int, ...] | list[int] = (), malformed: int = 0) -> Stage:
        stage = Stage(direct=direct, subagents=tuple(subagents), malformed=malformed)
        self.stages.append(stage)
        return stage

    @property
    def critical(self) -> int:
        return sum(s.critical for s in self.stages)

    @property
    def total(self) -> int:
        return sum(s.total for s in self.stages)

    @property
    def malformed(self) -> int:
        return sum(s.malformed for s in self.stages)


def critical_steps(stages: list[Stage]) -> int:
    """sum_t (1 + max_i S_sub,i(t))."""
    return sum(s.critical for s in stages)


def total_steps(stages: list[Stage]) -> int:
    """sum_t (max(1, ran_t) + sum_i S_sub,i(t))."""
    return sum(s.total for s in stages)
