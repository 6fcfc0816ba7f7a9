"""Splitting one step's training rows across ranks so that every rank has about the same work.

The loss is a sum over trained tokens divided by the whole step's token count, so any split of
the rows gives the same summed gradient; only the time differs, and a step takes as long as its
slowest rank. A row's cost is modelled from its length L as

    cost(L) = L + attention_weight * L**2

the linear part (projections, MLP: about 24·h² FLOPs a token for hidden size h) plus attention's
quadratic part (about 4·h·L a token), hence `attention_weight = 1 / (6 * hidden_size)` by default
(`attention_weight_for`). `pack` assigns rows greedily, longest cost first, to the rank with the
least cost so far (LPT scheduling: within 4/3 of the optimum); `split_groups` is the naive
alternative, each rank taking a contiguous share of the step's groups, kept to measure what
packing gains (`imbalance`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from slipstream.rl import TrainItem


def attention_weight_for(hidden_size: int) -> float:
    """The quadratic term's weight in `row_cost` for a model of this hidden size."""
    if hidden_size < 1:
        raise ValueError(f"hidden_size must be >= 1, got {hidden_size}")
    return 1.0 / (6.0 * hidden_size)


def row_cost(length: int, attention_weight: float) -> float:
    """Modelled cost of one row of `length` tokens (see the module docstring)."""
    return length + attention_weight * length * length


@dataclass(frozen=True)
class Split:
    """Rows per rank (indices into the step's rows) and what each rank carries."""

    rows: list[list[int]]
    tokens: list[int]
    """Tokens (prompt + completion) per rank."""
    costs: list[float]

    @property
    def imbalance(self) -> float:
        """max / mean tokens per rank (1.0 = perfectly even)."""
        return imbalance(self.tokens)

    @property
    def cost_imbalance(self) -> float:
        """max / mean modelled cost per rank."""
        return imbalance(self.costs)


def imbalance(loads: Sequence[float]) -> float:
    """max / mean of per-rank loads; 1.0 when all are equal (or all zero)."""
    if not loads:
        raise ValueError("imbalance needs at least one rank")
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def _split(items: Sequence[TrainItem], rows: list[list[int]], attention_weight: float) -> Split:
    lengths = [len(item.token_ids) for item in items]
    return Split(
        rows=[sorted(r) for r in rows],
        tokens=[sum(lengths[i] for i in r) for r in rows],
        costs=[sum(row_cost(lengths[i], attention_weight) for i in r) for r in rows],
    )


def pack(items: Sequence[TrainItem], ranks: int, *, attention_weight: float) -> Split:
    """Token-balanced split: rows by decreasing cost, each to the least loaded rank (ties: lowest index)."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    costs = [row_cost(len(item.token_ids), attention_weight) for item in items]
    order = sorted(range(len(items)), key=lambda i: (-costs[i], i))
    loads = [0.0] * ranks
    rows: list[list[int]] = [[] for _ in range(ranks)]
    for i in order:
        r = min(range(ranks), key=lambda k: (loads[k], k))
        rows[r].append(i)
        loads[r] += costs[i]
    return _split(items, rows, attention_weight)


def split_groups(
    group_sizes: Sequence[int], ranks: int, *, items: Sequence[TrainItem], attention_weight: float
) -> Split:
    """The naive split: rank k takes groups [k·G/W, (k+1)·G/W) whole. `group_sizes` are rows per group, in
    the order of `items`."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if sum(group_sizes) != len(items):
        raise ValueError(f"group sizes add up to {sum(group_sizes)}, not the {len(items)} rows")
    n = len(group_sizes)
    rows: list[list[int]] = [[] for _ in range(ranks)]
    start = 0
    for g, size in enumerate(group_sizes):
        rows[g * ranks // n].extend(range(start, start + size))
        start += size
    return _split(items, rows, attention_weight)
