"""How a local run reads its services' exit codes at the end (slipstream.run.training.stop_errors):
a drain timeout after the last step is named, not a failure; anything else fails the run."""

from __future__ import annotations

import pytest

from slipstream.run.training import stop_errors
from slipstream.runtime.lifecycle import EXIT_DRAIN_TIMEOUT

pytestmark = pytest.mark.unit


def test_a_drain_timeout_after_the_last_step_is_named_not_a_failure() -> None:
    codes = {"learner": 0, "rollout-worker": EXIT_DRAIN_TIMEOUT, "reward-model": None}
    assert stop_errors(codes, finished=True) == ({}, ["rollout-worker"])


def test_a_drain_timeout_before_the_last_step_and_other_codes_fail() -> None:
    assert stop_errors({"rollout-worker": 3}, finished=False) == ({"rollout-worker": 3}, [])
    assert stop_errors({"rollout-worker": 3, "learner": 1}, finished=True) == ({"learner": 1}, ["rollout-worker"])
    assert stop_errors({"learner": 2}, finished=True) == ({"learner": 2}, [])
