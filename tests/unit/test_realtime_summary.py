"""The realtime demo's per-cycle figures from what the simulator, the bus and the learner's outcome log said."""

from __future__ import annotations

import pytest

from slipstream.run.realtime import RealtimePlan
from slipstream.run.realtime_report import Observed, cycle_rows, session_of, summarize
from slipstream.run.sim import SimStats, Turn

pytestmark = pytest.mark.unit


def _turn(sid: str, version: int, accepted: bool, sent: float, turn: int = 0, n: int = 4) -> Turn:
    return Turn(
        session_id=sid,
        user=0,
        turn=turn,
        word="abc",
        answer="cba" if accepted else "xyz",
        accepted=accepted,
        version=version,
        segments=[[version, n]],
        call_id=f"{sid}-{turn}",
        sent_at=sent,
        answered_at=sent + 0.1,
    )


def test_session_of_reads_served_episode_ids_only() -> None:
    assert session_of("serve/sim0-u1-s7/0") == "sim0-u1-s7"
    assert session_of("reverse/123/4") == "" and session_of("serve") == ""


def test_cycles_report_acceptance_loop_time_staleness_and_the_gate() -> None:
    stats = SimStats()
    # v0 serves sessions a, b (1 of 2 accepted); v2 serves c, d (2 of 2).
    stats.turns = [_turn("a", 0, True, 100.0), _turn("b", 0, False, 101.0), _turn("b", 0, True, 101.5, turn=1)]
    stats.turns += [_turn("c", 2, True, 130.0), _turn("d", 2, True, 131.0)]
    stats.session_started = {"a": 100.0, "b": 101.0, "c": 130.0, "d": 131.0}
    seen = Observed(
        promotions=[
            {"policy_version": 0, "promoted_at": 99.0},
            {"policy_version": 2, "promoted_at": 120.0},
        ],
        evals=[
            {"policy_version": 0, "decision": "promote", "score": 0.3, "reason": "promote: first"},
            {"policy_version": 2, "decision": "promote", "score": 0.35, "baseline_version": 0, "reason": "ok"},
        ],
    )
    outcomes = [
        # Step 1 (-> v1) trained a; step 2 (-> v2) trained b, whose tokens were sampled by v0 (staleness 1).
        {"trajectory_id": "serve/a/0", "outcome": "trained", "policy_version": 1},
        {"trajectory_id": "serve/b/0", "outcome": "trained", "policy_version": 2},
        {"trajectory_id": "serve/x/0", "outcome": "dropped", "reason": "stale", "policy_version": 2},
    ]
    rows = cycle_rows(stats, seen, {0: 98.0, 2: 125.0}, outcomes)
    assert [r["version"] for r in rows] == [0, 2]
    assert rows[0]["acceptance"] == pytest.approx(2 / 3, abs=1e-4) and rows[0]["answers"] == 3
    assert rows[0]["acceptance_first_turn"] == 0.5
    assert rows[1]["acceptance"] == 1.0
    # Loop time of v2: its batch (session b) was first served at 101.0; serving ran v2 at 125.0.
    assert rows[1]["loop_time_s"] == 24.0 and rows[1]["batch_episodes"] == 1
    # Tokens trained into v1..v2: a's 4 tokens at staleness 0 (v0 under learner v0), b's 8 at 1.
    assert rows[1]["staleness"] == {
        "tokens": 12,
        "mean": pytest.approx(8 / 12, abs=1e-3),
        "max": 1,
        "histogram": {"0": 4, "1": 8},
    }
    assert rows[1]["gate"]["passed"] and rows[1]["rejected_before"] == []
    head = summarize(RealtimePlan().preference, stats, rows)
    assert head["acceptance_rise"] == pytest.approx(1 / 3, abs=1e-3)
    assert head["gate_passed_every_promotion"] and head["rises_every_cycle"]
    assert head["cycles_completed"] == 1 and head["loop_time_s_median"] == 24.0


def test_a_rejected_candidate_is_listed_in_the_next_promoted_cycle() -> None:
    seen = Observed(
        promotions=[{"policy_version": 0}, {"policy_version": 6}],
        evals=[
            {"policy_version": 0, "decision": "promote"},
            {"policy_version": 3, "decision": "reject", "reason": "worse than promoted v0 beyond margin"},
            {"policy_version": 6, "decision": "promote"},
        ],
    )
    rows = cycle_rows(SimStats(), seen, {}, [])
    assert rows[1]["rejected_before"] == [{"version": 3, "reason": "worse than promoted v0 beyond margin"}]
    assert "loop_time_s" not in rows[1] and rows[1]["staleness"] == {"tokens": 0}
