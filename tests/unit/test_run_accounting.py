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
    assert (tally.trained, tally.dropped, tally.settled, tally.repeats, tally.republished) == (
        3,
        {"stale": 1, "uniform_group": 1},
        6,
        2,
        1,  # d's second message: in the scored balance, not the raw one (one episode)
    )
    assert tally.ids == {"a", "b", "c", "d", "e"}
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


def test_a_scored_id_the_tap_missed_on_raw_is_not_injected_when_the_learner_settled_it() -> None:
    # nats-server restarted: the tap was reconnecting while a worker published g/1, so the tap saw
    # only its scored copy. The learner decoded and settled it: the reward-model's work.
    ids = TapIds()
    ids.raw({"Nats-Msg-Id": "g/0"})
    ids.scored({"Nats-Msg-Id": "g/0"})
    ids.scored({"Nats-Msg-Id": "g/1"})
    ids.scored({"Nats-Msg-Id": "forged/1"})  # never settled: an outsider's
    ids.scored(None)
    assert ids.untraced() == ids.injected_scored == 3
    assert ids.untraced({"g/0", "g/1"}) == 2


def test_the_raw_balance_counts_a_republished_episode_once(tmp_path: Path) -> None:
    # 4 episodes published raw; the reward-model scored all four, but `b`'s scored copy was stored
    # twice (republished after a restart forgot the duplicate window), and 3 outsiders' messages
    # without ids are in the scored stream too (dead-lettered by the learner).
    import asyncio
    from types import SimpleNamespace

    from slipstream.run.follow import account

    write(
        tmp_path / "learner-outcomes.jsonl",
        [
            {"trajectory_id": "a", "outcome": "trained", "sequences": [1]},
            {"trajectory_id": "b", "outcome": "trained", "sequences": [2, 6]},
            {"trajectory_id": "c", "outcome": "trained", "sequences": [3]},
            {"trajectory_id": "d", "outcome": "dropped", "reason": "stale", "sequences": [7]},
        ],
    )

    class Bus:
        async def stream_info(self, name: str) -> dict[str, int]:
            return {"TRAJ_RAW": {"last_seq": 4, "messages": 0}, "TRAJ_SCORED": {"last_seq": 8, "messages": 0}}[name]

        async def dead_letters(self, stream: str, limit: int) -> list[object]:
            return [object()] * (3 if stream == "TRAJ_SCORED" else 0)

        async def stored_sequences(self, stream: str) -> list[int]:
            return []

    ids = TapIds()
    for e in "abd":  # the tap missed c's raw publish (nats-server restarting)
        ids.raw({"Nats-Msg-Id": e})
    for e in "abbcd":
        ids.scored({"Nats-Msg-Id": e})
    for _ in range(3):
        ids.scored(None)
    stack = SimpleNamespace(spec=SimpleNamespace(run_dir=str(tmp_path)))
    out = asyncio.run(account(Bus(), SimpleNamespace(steps_log=[]), stack, ids.untraced))
    assert (out["scored"], out["republished_scored"], out["injected_scored"]) == (4, 1, 3), out
    assert out["accounted_raw"] and out["accounted_scored"], out
    # Without the learner's log the republish cannot be seen and the raw balance fails: it can fail.
    (tmp_path / "learner-outcomes.jsonl").unlink()
    ids.raw({"Nats-Msg-Id": "c"})
    out = asyncio.run(account(Bus(), SimpleNamespace(steps_log=[]), stack, ids.untraced))
    assert out["scored"] == 5 and not out["accounted_raw"], out
