"""`chatty`: arith where the warm-start pads a share of its answers with filler the verifier ignores."""

from __future__ import annotations

import pytest

from slipstream.envs import ChattyOptions, get_env
from slipstream.envs.chatty import DEFAULT_FILLER

pytestmark = pytest.mark.unit


def test_padded_and_terse_right_answers_score_the_same() -> None:
    env = get_env("chatty")
    (task,) = env.generate("train", 1, seed=0)
    terse = env.score(task, task.reference + "\n")
    padded = env.score(task, task.reference + DEFAULT_FILLER + "\n")
    assert (terse.reward, padded.reward, terse.correct, padded.correct) == (1.0, 1.0, True, True)
    wrong = env.score(task, str(int(task.reference) + 1) + DEFAULT_FILLER + "\n")
    assert (wrong.reward, wrong.correct) == (0.0, False)


def test_pad_rate_sets_the_share_of_padded_warm_start_examples() -> None:
    env = get_env("chatty", pad_rate=0.3)
    tasks = env.generate("train", 2000, seed=3)
    examples = [env.sft_example(t) for t in tasks]
    padded = [e for e in examples if e.endswith(DEFAULT_FILLER + "\n")]
    assert 0.27 <= len(padded) / len(examples) <= 0.33  # binomial sd ~0.01 at n = 2000
    assert all(e == t.reference + "\n" for e, t in zip(examples, tasks, strict=True) if e not in padded)
    assert examples == [env.sft_example(t) for t in tasks]  # a function of the task id: reproducible
    assert all(len(e) <= env.max_completion_chars for e in examples)
    assert [get_env("chatty", pad_rate=0.0).sft_example(t) for t in tasks[:50]] == [
        t.reference + "\n" for t in tasks[:50]
    ]
    # The same problem key is padded under some task ids and not others, so every key sees both forms.
    by_key: dict[str, set[bool]] = {}
    for t, e in zip(tasks, examples, strict=True):
        by_key.setdefault(t.metadata["key"], set()).add(e in padded)
    assert sum(1 for forms in by_key.values() if forms == {True, False}) > len(by_key) // 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pad_rate": 1.5}, "pad_rate must be in"),
        ({"filler": "a\nb"}, "without a newline"),
        ({"filler": "7 more"}, "must not start with a digit"),
        ({"format_reward": 2.0}, "correct_reward > format_reward"),
    ],
)
def test_bad_options_are_named(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ChattyOptions(**options)  # type: ignore[arg-type]
