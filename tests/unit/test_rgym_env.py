"""`reasoning_gym`: reasoning-gym's generators as a Slipstream environment, scored by its own verifier.

Reproducible by seed, held-out questions never training questions (although reasoning-gym's own
seeds s and s + 1 share items), the dataset's `score_answer` passed through, and options checked
when they are parsed."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from slipstream.envs import EnvError, get_env, task_of
from slipstream.schemas import Episode

pytestmark = pytest.mark.unit

rg = pytest.importorskip("reasoning_gym")

SPELL = {"dataset": "spell_backward", "config": {"min_word_len": 3, "max_word_len": 3}}
CHAIN = {"dataset": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}


def _env(options: dict[str, Any]) -> Any:
    return get_env("reasoning_gym", **options)


def test_tasks_are_a_function_of_split_and_seed() -> None:
    first, again = _env(SPELL).generate("train", 20, seed=3), _env(SPELL).generate("train", 20, seed=3)
    assert first == again  # a fresh instance (another process) makes the same tasks
    assert _env(SPELL).generate("train", 7, seed=3) == first[:7]
    other = _env(SPELL).generate("train", 20, seed=4)
    assert [t.prompt for t in other] != [t.prompt for t in first]
    assert first[0].prompt.startswith("Spell this word backward (example: sun -> nus): ")
    assert first[0].prompt.endswith("\nAnswer: ") and first[0].reference == first[0].prompt[48:51][::-1]


def test_a_call_may_need_more_items_than_one_dataset_holds() -> None:
    # The warm-start asks for tens of thousands of tasks at once: parts of `size` items, each its own stream.
    env = _env({**SPELL, "size": 50})
    tasks = env.generate("train", 120, seed=0)
    assert len({t.metadata["rg_seed"] for t in tasks}) >= 3 and tasks == env.generate("train", 120, seed=0)
    assert [env.score(t, t.reference).reward for t in tasks[-3:]] == [1.0, 1.0, 1.0]


def test_reasoning_gym_seeds_alone_repeat_items_so_splits_are_kept_apart_by_question() -> None:
    # Item i of a dataset seeded s is made from Random(s + i): seed 2 is seed 1 shifted by one.
    one = rg.create_dataset("chain_sum", seed=1, size=10, **CHAIN["config"])
    two = rg.create_dataset("chain_sum", seed=2, size=10, **CHAIN["config"])
    assert [two[i]["question"] for i in range(9)] == [one[i + 1]["question"] for i in range(9)]
    # chain_sum with one-digit terms has ~200 questions, so every stream repeats them; held-out
    # ones still never appear in training, under any seed.
    env = _env(CHAIN)
    train = {t.prompt for s in range(4) for t in env.generate("train", 100, seed=s)}
    heldout = {t.prompt for s in range(4) for t in env.generate("heldout", 20, seed=s)}
    assert len(train) > 100 and len(heldout) >= 10 and not train & heldout
    assert env.stream_seed("train", 0) != env.stream_seed("heldout", 0) != env.stream_seed("heldout", 1)


def test_the_score_is_reasoning_gyms_own() -> None:
    env = _env(SPELL)
    task = env.generate("heldout", 1, seed=0)[0]
    data = rg.create_dataset("spell_backward", seed=int(task.metadata["rg_seed"]), size=10_000, **SPELL["config"])
    entry = data[int(task.metadata["rg_index"])]
    assert entry["answer"] == task.reference
    right, partial = task.reference, task.reference[:2]
    for completion, expected in ((right + "\n", 1.0), (f" {right} \nmore", 1.0), (partial + "\n", 2 / 3), ("zzz", 0.0)):
        score = env.score(task, completion)
        answer = completion.partition("\n")[0].strip()
        assert score.reward == pytest.approx(data.score_answer(answer, entry)) == pytest.approx(expected)
        assert score.components == {"score": score.reward} and score.correct == (expected == 1.0)
    # Through the wire: the reward model sees only the episode (task_of), and scores it the same.
    episode = Episode(
        episode_id="e",
        task_id=task.task_id,
        env=env.name,
        split=task.split,
        reference=task.reference,
        metadata=dict(task.metadata),
        final_text=right + "\n",
    )
    assert env.score(task_of(episode), episode).reward == 1.0


def test_a_task_that_no_longer_matches_its_item_is_a_failure_naming_it() -> None:
    env = _env(SPELL)
    task = env.generate("train", 1, seed=0)[0]
    moved = msgspec.structs.replace(task, metadata={**task.metadata, "rg_index": "999"})
    score = env.score(moved, task.reference)
    assert score.reward == 0.0 and not score.parse_ok and "is not the task's question" in score.reason
    bare = msgspec.structs.replace(task, metadata={"key": task.metadata["key"]})
    assert "carries no reasoning-gym seed and index" in env.score(bare, task.reference).reason


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"dataset": "spell_forward"}, r"unknown reasoning-gym dataset 'spell_forward'; known: ab, acre, "),
        ({"dataset": "chain_sum", "config": {"terms": 2}}, r"unknown config field\(s\) terms for 'chain_sum'; known: "),
        ({"dataset": "chain_sum", "config": {"seed": 2}}, r"unknown config field\(s\) seed"),
        ({"dataset": "chain_sum", "config": {"min_terms": 3, "max_terms": 2}}, r"max_terms must be >= min_terms"),
        ({"datasett": "chain_sum"}, r"unknown option\(s\) datasett for environment 'reasoning_gym'; known: dataset"),
    ],
)
def test_bad_options_are_errors_naming_them(options: dict[str, Any], expected: str) -> None:
    with pytest.raises(EnvError, match=expected):
        _env(options)
