"""The run summary's accounting inputs: the learner's outcome log reduced per trajectory, and the taps' ids."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from slipstream.run.follow import outcome_counts, outcome_tally
from slipstream.run.tap import TapIds

pytestmark = pytest.mark.unit


def write(path: Path, rows: list[dict[str, object]]) -> None:
    path.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in rows))


def test_a_trajectory_counts_once_however_often_a_restarted_learner_saw_it(tmp_path: Path) -> None:
    log = tmp_path / "outcomes.jsonl"
    write(
        log,
        [
            {"trajectory_id": "a", "outcome": "trained", "sequences": [1]},
            {"trajectory_id": "b", "outcome": "dropped", "reason": "stale", "sequences": [2]},
            # The learner was killed after committing `a` and dropping `b`, before its acks went out:
            {"trajectory_id": "a", "outcome": "dropped", "reason": "duplicate", "sequences": [1]},
            {"trajectory_id": "b", "outcome": "dropped", "reason": "stale", "sequences": [2]},
            # Only ever seen as a duplicate: its id is in a committed checkpoint, so it was trained.
            {"trajectory_id": "c", "outcome": "dropped", "reason": "duplicate", "sequences": [3]},
            # Two stream messages of one episode (a republish after the duplicate window).
            {"trajectory_id": "d", "outcome": "trained", "sequences": [4, 9]},
            # An older learner's line, without sequences: one message.
            {"trajectory_id": "e", "outcome": "dropped", "reason": "uniform_group"},
        ],
    )
    tally = outcome_tally(log)
    assert tally is not None
    assert (tally.trained, tally.dropped, tally.settled, tally.repeats) == (
        3,
        {"stale": 1, "uniform_group": 1},
        6,
        2,
    )
    assert outcome_counts(log) == {"trained": 3, "stale": 1, "uniform_group": 1}
    assert outcome_tally(tmp_path / "none.jsonl") is None and outcome_counts(tmp_path / "none.jsonl") == {}


def test_scored_messages_no_raw_trajectory_accounts_for_are_counted_as_injected() -> None:
    ids = TapIds()
    for i in range(3):
        ids.raw({"Nats-Msg-Id": f"g/{i}"})
    ids.scored({"Nats-Msg-Id": "g/0"})
    ids.scored({"Nats-Msg-Id": "g/0"})  # a retried publish the stream stored once
    ids.scored({"Nats-Msg-Id": "g/1"})
    ids.scored({"Nats-Msg-Id": "forged/1"})
    ids.scored(None)  # garbage with no headers at all
    ids.scored({})
    assert ids.injected_scored == 3
