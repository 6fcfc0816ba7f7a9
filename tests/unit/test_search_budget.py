"""The `search` demo plan's budget needs pruning (issue 33): two scripted teachers on the real harness.

`slipstream bench search-budget` measures 200 train and 200 held-out tasks; this plays 24 of each
(the plan's corpus, BM25 backend, byte tokenizer) so the sizing cannot drift unseen.
"""

from __future__ import annotations

import pytest

from slipstream.bench.search_budget import measure, warm_start_kept
from slipstream.envs import get_env
from slipstream.envs.search.expert import _draw
from slipstream.run.presets import demo_plan

SEARCH_OPTIONS = demo_plan("search").env_options

pytestmark = [pytest.mark.unit, pytest.mark.slow]


def test_a_teacher_that_never_prunes_fails_at_the_budget_and_one_that_prunes_succeeds() -> None:
    result = measure(SEARCH_OPTIONS, tasks=24)
    teachers = result["teachers"]
    for split in ("train", "heldout"):
        never, prunes = teachers["never_prunes"][split], teachers["prunes"][split]
        assert never["final_answer_found"] <= 0.5, split
        assert never["prune_share"] == 0.0 and "prune_accuracy" not in never
        assert never["failed_blocked_share"] >= 0.9, split  # its failures are the budget's doing
        assert prunes["final_answer_found"] >= 0.9 and prunes["prune_share"] == 1.0, split
        assert prunes["prune_accuracy"] == 1.0 and prunes["turns_median"] > 2
        assert set(prunes["hops"]) == {"2", "3"}
    held = result["heldout"]
    assert held["shared_documents"] == 0 and held["shared_entities"] == 0
    assert {"thread", "meeting"} <= set(held["question_words_unseen_in_training"])


def test_the_warm_start_teacher_prunes_on_at_most_a_tenth_of_the_tasks() -> None:
    env = get_env("search", **SEARCH_OPTIONS)
    rate = SEARCH_OPTIONS["expert_prune_rate"]
    assert 0 < rate <= 0.1
    keys = [t.key for t in env.corpus.tasks]
    share = sum(_draw(k, "prune") < rate for k in keys) / len(keys)
    assert len(keys) > 800 and 0.01 <= share <= 0.1


def test_what_the_warm_start_trains_on_prunes_in_at_most_a_tenth_of_its_episodes() -> None:
    """The SFT filter keeps the episodes that found their targets, mostly the pruning ones: the share
    among the kept episodes (what the model copies), not the teacher's rate, is what must stay <= 0.1."""
    kept = warm_start_kept(SEARCH_OPTIONS)
    assert kept["episodes"] > 600 and 0 < kept["teacher_prune_share"] < kept["kept_prune_share"] <= 0.1
    assert kept["kept"] > 150
    at_8 = warm_start_kept({**SEARCH_OPTIONS, "expert_prune_rate": 0.08})  # the plan before session 30
    assert at_8["teacher_prune_share"] <= 0.1 < at_8["kept_prune_share"]
