"""The grader's pieces that need no sandbox: the by-value codec and how each task kind is graded."""

from __future__ import annotations

import ast
import math

import pytest

from slipstream.envs.code import grader, task_of_key


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        -7,
        2**70,
        1.5,
        float("inf"),
        "a'\"\n",
        b"\x00b",
        [1, (2, "x")],
        {"k": [None]},
        {3},
        frozenset({4}),
    ],
)
def test_the_codec_round_trips_exact_builtin_values_with_their_types(value: object) -> None:
    back = grader.decode(ast.literal_eval(grader.encode(value)))
    assert back == value and type(back) is type(value)


def test_the_codec_keeps_types_apart_and_refuses_other_objects() -> None:
    tags = {grader.encode(v) for v in (1, True, 1.0, "1", (1,), [1])}
    assert len(tags) == 6  # 1, True and 1.0 are equal in Python, not in a grade
    assert math.isnan(grader.decode(ast.literal_eval(grader.encode(float("nan")))))

    class MyInt(int):
        pass

    with pytest.raises(ValueError, match=r"not a plain value: .*MyInt"):
        grader.encode(MyInt(3))


def test_a_bugfix_task_is_graded_through_its_function_with_hidden_cases() -> None:
    bug = grader.spec_of(task_of_key("bugfix:1"))
    assert isinstance(bug, grader.CallSpec)
    assert (bug.module, bug.entry, bug.hidden, bug.strict) == ("ops", "fold", grader.HIDDEN_CASES, True)
    assert bug.modules[0] == ("ops", task_of_key("bugfix:1").meta["fixed"]) and bug.tests == ("test_ops",)
    # (HumanEval's and toolz's specs are graded end to end in tests/integration/test_code_red_team.py.)
    assert grader.graded_paths(task_of_key("bugfix:1"), bug) is None
