"""The chaos suite's joins: trained twice, lost, dropped, announced twice and corrupted-and-applied are
computed from records, and each one moves when the records say something went wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.chaos.accounting import (
    AnnounceRecord,
    corrupted_applied,
    join_trajectories,
    versions_announced_twice,
)
from slipstream.chaos.audit import applied_versions, refused_versions
from slipstream.chaos.suite import parse_faults

pytestmark = pytest.mark.unit


def trained(tid: str, step: int = 1) -> dict[str, object]:
    return {"trajectory_id": tid, "outcome": "trained", "step": step}


def dropped(tid: str, reason: str) -> dict[str, object]:
    return {"trajectory_id": tid, "outcome": "dropped", "reason": reason}


def test_a_clean_run_balances() -> None:
    published = {"a", "b", "c", "d", "e"}
    j = join_trajectories(published, [trained("a"), trained("b"), dropped("c", "stale")], {"d"}, {"e"})
    assert (j.published, j.trained, j.dropped, j.dead_lettered, j.left) == (5, 2, {"stale": 1}, 1, 1)
    assert j.trained_twice == 0 and j.lost == 0 and j.untracked_by_tap == 0


def test_a_trajectory_nothing_accounts_for_is_lost_by_id() -> None:
    j = join_trajectories({"a", "b", "gone"}, [trained("a"), trained("b")], set(), set())
    assert j.lost == 1 and j.lost_ids == ["gone"]


def test_two_trained_lines_are_trained_twice_but_one_trajectory() -> None:
    j = join_trajectories({"a", "b"}, [trained("a", 1), trained("a", 2), trained("b")], set(), set())
    assert j.trained_twice == 1 and j.trained == 2 and j.lost == 0


def test_a_duplicate_after_a_restart_is_trained_once_not_twice() -> None:
    # The learner killed after its commit and before its acks: the next one sees the id again.
    j = join_trajectories({"a"}, [trained("a"), dropped("a", "duplicate")], set(), set())
    assert j.trained == 1 and j.trained_twice == 0 and j.dropped == {}


def test_a_drop_then_a_train_counts_as_trained() -> None:
    j = join_trajectories({"a"}, [dropped("a", "incomplete_group"), trained("a")], set(), set())
    assert j.trained == 1 and j.dropped == {}


def test_ids_the_tap_missed_are_published_but_counted_as_untracked() -> None:
    # Seen by the learner, never by the tap (it was reconnecting while NATS restarted).
    j = join_trajectories({"a"}, [trained("a"), trained("b")], set(), {"c"})
    assert j.published == 3 and j.untracked_by_tap == 2 and j.lost == 0 and j.left == 1


def test_settled_ids_are_not_also_counted_as_left_or_dead() -> None:
    j = join_trajectories({"a", "b"}, [trained("a"), dropped("b", "stale")], {"a"}, {"b"})
    assert (j.trained, j.dead_lettered, j.left) == (1, 0, 0)
    # ... but a settled id still in a stream is listed: its ack never reached the server.
    assert j.settled_but_left == ["b"] and j.as_dict()["settled_but_left"] == 1


def test_versions_announced_twice_counts_genuine_announces_only() -> None:
    records = [
        AnnounceRecord(1, True),
        AnnounceRecord(2, True),
        AnnounceRecord(2, False, "fence token not the signed one"),  # a spoofed re-announce
        AnnounceRecord(3, True),
    ]
    assert versions_announced_twice(records) == {}
    assert versions_announced_twice([*records, AnnounceRecord(3, True)]) == {3: 2}


def test_corrupted_applied_only_counts_applies_after_the_corruption() -> None:
    corrupted = {9: 100.0}
    assert corrupted_applied(corrupted, [(8, 90.0), (9, 95.0), (10, 120.0)]) == []  # v9 applied while sound
    assert corrupted_applied(corrupted, [(9, 101.0)]) == [9]


def test_worker_log_lines_are_read_for_applied_and_refused_versions(tmp_path: Path) -> None:
    log = tmp_path / "rollout-worker.log"
    log.write_text(
        '{"event": "applied weights", "policy_version": 8, "timestamp": "2026-11-24T06:00:00.000000Z"}\n'
        "not json at all\n"
        '{"event": "weight version skipped; still sampling with the current one", "policy_version": 9,'
        ' "reason": "fetch", "timestamp": "2026-11-24T06:00:01Z"}\n'
        '{"event": "applied weights", "policy_version": 10, "timestamp": "2026-11-24T06:00:02Z"}\n'
        '{"event": "weight fetch failed; retrying", "policy_version": 19, "error": "CorruptShard(\'shard x\')"}\n'
        '{"event": "weight fetch failed; retrying", "policy_version": 29, "error": "OSError()"}\n'
    )
    versions = applied_versions(log)
    assert [v for v, _ in versions] == [8, 10]
    assert versions[1][1] - versions[0][1] == pytest.approx(2.0)
    assert refused_versions(log) == {9, 19}  # an OSError is not a refusal


def test_an_unknown_fault_is_named() -> None:
    assert parse_faults("inject, kill:learner") == ["inject", "kill:learner"]
    with pytest.raises(ValueError, match="kill:nats"):
        parse_faults("inject,kill:nats")
