"""Context-1's reward, exactly, as pure functions with named components.

    r = clamp(0.7 * F_beta + 0.3 * r_traj + r_fa - p_prune - p_turn,  floor,  r_pre)

- `f_beta(output, targets, beta)`: F_beta over the output set of document ids,
  (1 + beta^2) P R / (beta^2 P + R); beta = 4 at the start (recall weighted 16x), annealed to 2
  (`annealed_beta`; the environment steps it by the policy version that sampled the episode,
  `SearchOptions.beta_at`).
- `trajectory_recall(seen, targets)`: the fraction of target documents seen at any point of the
  episode, pruned or not (the full, unpruned log).
- r_fa: +1.0 when a document whose chunk contains the final answer is in the output.
- `prune_streak_penalty(calls)`: 0.1 per prune call beyond 3 in a row (the 4th consecutive
  prune is the first excess one), summed over streaks, capped at 0.5.
- `turn_penalty(turns, start, end, max_penalty)`: 0 up to `start` (64) turns, rising linearly to
  `max_penalty` (0.5) at `end` (128) and flat beyond; scaled down with the budget for small runs.

The clamp, as chosen here (the report leaves its order open, techniques.md §4.3): the floor is
applied first and the pre-penalty value caps it, `r = min(max(raw, floor), r_pre)` with
`r_pre = 0.7 F + 0.3 r_traj + r_fa`. So a trajectory that found something (r_pre > 0) keeps at
least min(floor, r_pre) however large its penalties, one that found nothing (r_pre = 0) gets 0,
and the floor can never lift a reward above what the trajectory earned before penalties: a
penalised success always beats a failure. An episode that errored or whose output is malformed
scores 0 (`RewardBreakdown.failure`).

`RewardBreakdown.components` names every term so they sum to the reward: `f_beta`, `traj_recall`
(the weighted terms), `final_answer`, `prune_penalty`, `turn_penalty` (negative) and `clamp`
(what the clamp added or removed).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence

import msgspec

F_WEIGHT = 0.7
TRAJ_WEIGHT = 0.3
ANSWER_BONUS = 1.0
PRUNE_TOOL = "prune_chunks"

COMPONENTS: tuple[str, ...] = ("f_beta", "traj_recall", "final_answer", "prune_penalty", "turn_penalty", "clamp")


class RewardConfig(msgspec.Struct, kw_only=True, frozen=True):
    """The reward's knobs; the defaults are Context-1's (the floor is not disclosed: ours is 0.01)."""

    beta: float = 4.0
    floor: float = 0.01
    answer_bonus: float = ANSWER_BONUS
    prune_free_streak: int = 3
    prune_step: float = 0.1
    prune_cap: float = 0.5
    turn_start: int = 64
    turn_end: int = 128
    turn_max_penalty: float = 0.5

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        if self.floor < 0:
            raise ValueError(f"floor must be >= 0, got {self.floor}")
        if not 0 <= self.turn_start < self.turn_end:
            raise ValueError(f"need 0 <= turn_start < turn_end, got {self.turn_start}, {self.turn_end}")
        if self.prune_free_streak < 0 or self.prune_step < 0 or self.prune_cap < 0 or self.turn_max_penalty < 0:
            raise ValueError("prune_free_streak, prune_step, prune_cap and turn_max_penalty must be >= 0")


class RewardBreakdown(msgspec.Struct, kw_only=True, frozen=True):
    """One episode's reward with every term named; `components` sum to `reward`."""

    reward: float
    pre_penalty: float
    precision: float
    recall: float
    f_beta: float
    traj_recall: float
    final_answer: bool
    prune_penalty: float
    turn_penalty: float

    @property
    def components(self) -> dict[str, float]:
        weighted_f = F_WEIGHT * self.f_beta
        weighted_traj = TRAJ_WEIGHT * self.traj_recall
        bonus = self.pre_penalty - weighted_f - weighted_traj
        raw = self.pre_penalty - self.prune_penalty - self.turn_penalty
        return {
            "f_beta": weighted_f,
            "traj_recall": weighted_traj,
            "final_answer": bonus,
            "prune_penalty": -self.prune_penalty,
            "turn_penalty": -self.turn_penalty,
            "clamp": self.reward - raw,
        }


def precision_recall(output: Collection[str], targets: Collection[str]) -> tuple[float, float]:
    """Set precision and recall of `output` against `targets` (0.0 for an empty side)."""
    out, want = set(output), set(targets)
    hits = len(out & want)
    precision = hits / len(out) if out else 0.0
    recall = hits / len(want) if want else 0.0
    return precision, recall


def f_beta(output: Collection[str], targets: Collection[str], beta: float) -> float:
    """F_beta = (1 + b^2) P R / (b^2 P + R); 0.0 when nothing relevant was output."""
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    precision, recall = precision_recall(output, targets)
    if precision == 0.0 or recall == 0.0:
        return 0.0
    b2 = beta * beta
    return (1 + b2) * precision * recall / (b2 * precision + recall)


def trajectory_recall(seen: Collection[str], targets: Collection[str]) -> float:
    """Fraction of target documents seen at any point (pruned or not)."""
    return precision_recall(seen, targets)[1]


def annealed_beta(epoch: int, epochs: int, *, start: float = 4.0, end: float = 2.0) -> float:
    """beta for `epoch` (0-based) of `epochs`: `start` in the first, linear to `end` in the last.

    The search environment calls it with epoch = the policy version (capped) and epochs = the
    anneal's versions + 1 (`SearchOptions.beta_at`)."""
    if epochs < 1 or not 0 <= epoch < epochs:
        raise ValueError(f"need 0 <= epoch < epochs, got epoch={epoch}, epochs={epochs}")
    if epochs == 1:
        return start
    return start + (end - start) * epoch / (epochs - 1)


def prune_streaks(calls: Iterable[str]) -> list[int]:
    """Lengths of the runs of consecutive prune calls in a sequence of tool-call names."""
    streaks: list[int] = []
    run = 0
    for name in calls:
        if name == PRUNE_TOOL:
            run += 1
            continue
        if run:
            streaks.append(run)
        run = 0
    if run:
        streaks.append(run)
    return streaks


def prune_streak_penalty(calls: Iterable[str], *, free: int = 3, step: float = 0.1, cap: float = 0.5) -> float:
    """`step` per prune call beyond `free` in a row, summed over streaks, at most `cap`."""
    excess = sum(max(0, n - free) for n in prune_streaks(calls))
    return min(cap, step * excess)


def turn_penalty(turns: int, *, start: int = 64, end: int = 128, max_penalty: float = 0.5) -> float:
    """0 up to `start` turns, linear to `max_penalty` at `end`, flat beyond."""
    if turns <= start:
        return 0.0
    return max_penalty * min(1.0, (turns - start) / (end - start))


def scaled_turn_window(budget_tokens: int, *, reference_budget: int = 32_768, minimum: int = 8) -> tuple[int, int]:
    """The turn-penalty window (64, 128) scaled with the token budget, never below (8, 16).

    Context-1's window belongs to a 32k budget; a run with a budget an eighth the size fills its
    context in about an eighth the turns. The minimum keeps room for a 3-hop task's searches,
    reads and a prune (about 7 turns) before any penalty.
    """
    scale = budget_tokens / reference_budget
    start = max(minimum, math.ceil(64 * scale))
    return start, max(2 * minimum, math.ceil(128 * scale))


def reward(
    *,
    output: Sequence[str],
    targets: Collection[str],
    seen: Collection[str],
    answer_docs: Collection[str],
    tool_calls: Sequence[str],
    turns: int,
    config: RewardConfig = RewardConfig(),
) -> RewardBreakdown:
    """The reward of a finished episode: ranked `output` doc ids, every doc `seen` (unpruned log),
    the docs whose chunks hold the final answer, the tool-call names in order, the turns taken."""
    precision, recall = precision_recall(output, targets)
    fb = f_beta(output, targets, config.beta)
    traj = trajectory_recall(seen, targets)
    found = bool(set(output) & set(answer_docs))
    pre = F_WEIGHT * fb + TRAJ_WEIGHT * traj + (config.answer_bonus if found else 0.0)
    p_prune = prune_streak_penalty(
        tool_calls, free=config.prune_free_streak, step=config.prune_step, cap=config.prune_cap
    )
    p_turn = turn_penalty(turns, start=config.turn_start, end=config.turn_end, max_penalty=config.turn_max_penalty)
    value = min(max(pre - p_prune - p_turn, config.floor), pre)
    return RewardBreakdown(
        reward=value,
        pre_penalty=pre,
        precision=precision,
        recall=recall,
        f_beta=fb,
        traj_recall=traj,
        final_answer=found,
        prune_penalty=p_prune,
        turn_penalty=p_turn,
    )
