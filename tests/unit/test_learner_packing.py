"""Token-balanced packing of a step's rows across ranks, and the equal micro-batch counts ranks need."""

from __future__ import annotations

import random

import pytest

from slipstream.learner.packing import attention_weight_for, imbalance, pack, row_cost, split_groups
from slipstream.learner.ranks import rank_chunks
from slipstream.learner.trainer import micro_batches
from slipstream.rl import TrainItem

pytestmark = pytest.mark.unit


def item(length: int) -> TrainItem:
    completion = length - 2
    return TrainItem(
        token_ids=[1] * length,
        prompt_len=2,
        behaviour_logprobs=[-1.0] * completion,
        loss_mask=[1] * completion,
        advantage=1.0,
    )


def skewed_step(seed: int) -> tuple[list[TrainItem], list[int]]:
    """Groups of 4 whose lengths differ a lot between groups (one task's answers are long, another's short)."""
    rng = random.Random(seed)
    items: list[TrainItem] = []
    sizes: list[int] = []
    for _ in range(8):
        base = rng.choice([6, 12, 40, 120])
        for _ in range(4):
            items.append(item(base + rng.randrange(4)))
        sizes.append(4)
    return items, sizes


def test_every_row_goes_to_exactly_one_rank() -> None:
    items, _ = skewed_step(0)
    split = pack(items, 3, attention_weight=attention_weight_for(128))
    assigned = sorted(i for rows in split.rows for i in rows)
    assert assigned == list(range(len(items)))
    assert sum(split.tokens) == sum(len(it.token_ids) for it in items)


@pytest.mark.parametrize("seed", range(5))
def test_packing_balances_better_than_splitting_groups(seed: int) -> None:
    items, sizes = skewed_step(seed)
    w = attention_weight_for(128)
    packed = pack(items, 2, attention_weight=w)
    naive = split_groups(sizes, 2, items=items, attention_weight=w)
    assert packed.cost_imbalance <= naive.cost_imbalance
    # LPT is within 4/3 of the optimum, and the optimum here is close to even.
    assert packed.cost_imbalance < 1.1
    assert packed.imbalance < 1.2


def test_cost_counts_attention_quadratically() -> None:
    w = attention_weight_for(64)
    assert row_cost(100, w) - 100 == pytest.approx(4 * (row_cost(50, w) - 50))
    # One long row against many short ones of the same token count: packing weighs the long one more.
    items = [item(600)] + [item(60)] * 12
    split = pack(items, 2, attention_weight=w)
    long_rank = next(r for r, rows in enumerate(split.rows) if 0 in rows)
    assert split.tokens[long_rank] < split.tokens[1 - long_rank]


def test_imbalance_and_errors() -> None:
    assert imbalance([5, 5]) == 1.0
    assert imbalance([6, 2]) == 1.5
    assert imbalance([0, 0]) == 1.0
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        pack([item(5)], 0, attention_weight=0.0)
    with pytest.raises(ValueError, match="group sizes add up to 3"):
        split_groups([3], 2, items=[item(5)], attention_weight=0.0)


def test_ranks_get_equal_micro_batch_counts() -> None:
    items = [item(n) for n in (5, 6, 7, 8, 9, 30, 31)]
    split = pack(items, 2, attention_weight=0.0)
    chunks = rank_chunks(items, split, micro_batch=2)
    assert len(chunks[0]) == len(chunks[1])
    assert all(len(c) <= 2 for rank in chunks for c in rank)
    assert sorted(len(x.token_ids) for rank in chunks for c in rank for x in c) == [5, 6, 7, 8, 9, 30, 31]
    # A rank with no rows still gets passes to join (empty micro-batches).
    alone = rank_chunks([item(5)], pack([item(5)], 2, attention_weight=0.0), micro_batch=4)
    assert [len(c) for c in alone[0]] == [1] and [len(c) for c in alone[1]] == [0]


def test_micro_batches_with_a_count() -> None:
    items = [item(n) for n in (9, 5, 7, 6, 8)]
    assert [len(c) for c in micro_batches(items, 2)] == [2, 2, 1]
    assert [len(c) for c in micro_batches(items, 4, count=3)] == [2, 2, 1]
    assert [len(x.token_ids) for c in micro_batches(items, 4, count=2) for x in c] == [5, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="do not fit 1 micro-batches"):
        micro_batches(items, 2, count=1)
