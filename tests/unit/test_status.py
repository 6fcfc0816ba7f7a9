"""`slipstream status` and the promotion commands' pure parts: reading stack.json, shaping rows, rendering.

No sockets: the parts that probe servers are covered by tests/integration/test_eval_gate.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from rich.console import Console

from slipstream.cli import promotion
from slipstream.cli import status as status_command
from slipstream.stack import status
from slipstream.stack.stackfile import ServiceEntry, StackFile

pytestmark = pytest.mark.unit


def _raw(tmp_path: Path) -> dict[str, Any]:
    return {
        "version": 1,
        "state": "ready",
        "run_id": "r1",
        "run_dir": str(tmp_path),
        "servers": {"nats": {"url": "nats://127.0.0.1:4333"}, "redis": {"url": "redis://127.0.0.1:6399"}},
        "store": {"type": "local", "root": str(tmp_path / "store"), "url": "", "endpoint_url": ""},
        "services": {"eval-gate": {"pid": 7, "port": 9999, "url": "http://127.0.0.1:9999"}},
    }


def _info(tmp_path: Path) -> StackFile:
    return msgspec.convert(_raw(tmp_path), StackFile)


def test_load_stack_reads_a_stack_json(tmp_path: Path) -> None:
    (tmp_path / "stack.json").write_text(json.dumps(_raw(tmp_path)))
    info = status.load_stack(tmp_path)
    assert info.run_id == "r1" and info.server_url("nats") == "nats://127.0.0.1:4333"
    assert info.services["eval-gate"].port == 9999 and info.services["eval-gate"].restarts == 0
    assert info.store.root == str(tmp_path / "store")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no stack.json in"),
        ("{not json", "cannot read"),
        ("[1, 2]", "is not a JSON object"),
        (json.dumps({"run_id": "r", "servers": {}, "services": {}}), "has no 'store'"),
        (json.dumps({"run_id": "r", "servers": {"nats": {"url": "x"}}, "services": {}, "store": {}}), "no redis"),
    ],
)
def test_load_stack_names_what_is_wrong(tmp_path: Path, content: str | None, message: str) -> None:
    if content is not None:
        (tmp_path / "stack.json").write_text(content)
    with pytest.raises(status.StatusError, match=message):
        status.load_stack(tmp_path)


def test_status_command_without_a_stack_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = status_command.run(argparse.Namespace(run_dir=tmp_path / "none", json=False, timeout=1.0))
    assert code == 2
    assert "no stack.json" in capsys.readouterr().out


def test_service_row_reads_health_and_version_from_readyz() -> None:
    svc = ServiceEntry(pid=11, url="http://127.0.0.1:1", restarts=2)
    body = {"state": "running", "status": {"policy_version": 5, "weights": {"follow": "promoted"}}}
    row = status.service_row("rollout-worker", svc, 200, body)
    assert row == {
        "name": "rollout-worker",
        "pid": 11,
        "url": "http://127.0.0.1:1",
        "health": "ready",
        "restarts": 2,
        "policy_version": 5,
        "follow": "promoted",
    }
    assert status.service_row("learner", ServiceEntry(pid=1), 200, None)["restarts"] == 0  # an older stack.json
    gate = status.service_row("eval-gate", svc, 200, {"status": {"control": {"redis": "degraded"}}})
    assert gate["redis"] == "degraded" and gate["policy_version"] is None
    assert status.service_row("learner", svc, 503, {"state": "starting"})["health"] == "not ready (starting)"
    assert status.service_row("learner", svc, 503, None)["health"] == "not ready (503)"
    assert status.service_row("learner", svc, None, None)["health"] == "no answer"


def test_service_row_shows_refused_announces_and_a_stall() -> None:
    svc = ServiceEntry(pid=11, url="http://127.0.0.1:1")
    refused = {"missing_manifest": 1, "fence": 2}
    worker = {"status": {"weights": {"announces": {"signatures": "required", "refused": refused}}}}
    assert status.service_row("rollout-worker", svc, 200, worker)["refused_announces"] == refused
    source = {"status": {"announces": {"refused": {"unsigned": 1}}}}
    assert status.service_row("task-source", svc, 200, source)["refused_announces"] == {"unsigned": 1}
    assert "refused_announces" not in status.service_row("learner", svc, 200, {"status": {}})
    verified = {"status": {"weights": {"announced_version": 7, "announces": {"signatures": "required"}}}}
    assert status.service_row("rollout-worker", svc, 200, verified)["verified_version"] == 7
    unverifying = {"status": {"weights": {"announced_version": 7}}}  # an older worker: no verifier
    assert "verified_version" not in status.service_row("rollout-worker", svc, 200, unverifying)
    stalled = {
        "state": "running",
        "status": {"progress": {"stalled": True, "reason": "2 task(s) held; nothing advanced for 301 s"}},
    }
    row = status.service_row("rollout-worker", svc, 503, stalled)
    assert row["health"] == "not ready (stalled: 2 task(s) held; nothing advanced for 301 s)"
    snap = _snapshot()
    snap["services"][0]["refused_announces"] = refused
    assert "fence 2, missing_manifest 1" in _text(status.render(snap))


def test_stream_row_and_dlq_counts() -> None:
    info = {
        "name": "TASKS",
        "messages": 12,
        "consumers": {
            "rollout-worker": {"num_pending": 9, "num_ack_pending": 3, "num_redelivered": 1},
            "Xy7ephemeral": {"num_pending": 1},
        },
    }
    assert status.stream_row(info, frozenset({"rollout-worker"})) == {
        "name": "TASKS",
        "messages": 12,
        "consumers": {"rollout-worker": {"pending": 9, "ack_pending": 3}},
        "readers": 1,
    }
    counts = status.dlq_counts({"dlq.TASKS": 2, "dlq.TRAJ_RAW": 5}, ["TASKS", "TRAJ_RAW", "WEIGHTS", "DLQ"])
    assert counts == {"TASKS": 2, "TRAJ_RAW": 5, "WEIGHTS": 0}


def _snapshot(**over: Any) -> dict[str, Any]:
    snap: dict[str, Any] = {
        "run_id": "r1",
        "run_dir": "/runs/r1",
        "state": "ready",
        "servers": [
            {"name": "nats", "url": "nats://h:1", "up": True},
            {"name": "redis", "url": "redis://h:2", "up": True},
        ],
        "services": [
            {
                "name": "rollout-worker",
                "pid": 3,
                "url": "u",
                "health": "ready",
                "policy_version": 7,
                "versions_behind": 2,
            }
        ],
        "streams": [
            {"name": "TASKS", "messages": 4, "consumers": {"rollout-worker": {"pending": 4, "ack_pending": 1}}},
            {"name": "EVAL", "messages": 9, "consumers": {}},
        ],
        "dlq": {"TASKS": 3, "EVAL": 0},
        "versions": {
            "latest": 9,
            "promoted": 6,
            "promotion_stack": [0, 6],
            "last_eval": {
                "policy_version": 8,
                "suite": "heldout",
                "score": 0.0,
                "ci": [0.0, 0.0],
                "baseline_version": 6,
                "decision": "reject",
                "reason": "below floor: 0.00 < 0.05",
            },
        },
        "learner": {
            "step": 9,
            "policy_version": 9,
            "run_id": "r1",
            "reward_mean": 0.4,
            "accuracy": 0.3,
            "staleness": {"0": 10, "1": 22},
            "dropped": {"stale": 4},
            "episodes": {
                "trained": 32,
                "samples": 48,
                "turns_per_episode": 3.5,
                "tool_calls_per_turn": 0.5,
                "invalid_call_rate": 0.125,
                "samples_per_episode": 1.5,
            },
        },
        "errors": [],
    }
    snap.update(over)
    return snap


def _text(parts: list[Any]) -> str:
    console = Console(width=200, record=True, color_system=None)
    for p in parts:
        console.print(p)
    return console.export_text()


def test_render_shows_every_part() -> None:
    text = _text(status.render(_snapshot()))
    assert "run r1 (ready)" in text
    assert "rollout-worker" in text and "v7" in text
    assert "TASKS" in text and "unacked" in text
    assert "v6  (stack v0 -> v6)" in text
    assert "v8 reject: score 0.000" in text and "below floor" in text
    assert "step 9 -> v9" in text and "0:10, 1:22" in text and "stale: 4" in text
    assert "32 trained (48 samples): 3.50 turns/episode, 0.50 tool calls/turn, invalid-call rate 0.125" in text


def test_render_falls_back_to_the_last_promotion_message() -> None:
    versions = {"latest": 3, "promoted": None, "last_promoted_message": {"policy_version": 2}}
    text = _text(status.render(_snapshot(versions=versions, learner=None)))
    assert "v2 (last weights.promoted; Redis has none)" in text


def test_exit_code_is_0_only_when_everything_answers() -> None:
    assert status.exit_code(_snapshot()) == 0
    down = _snapshot(servers=[{"name": "nats", "url": "x", "up": False}])
    assert status.exit_code(down) == 1
    unready = _snapshot(services=[{"name": "learner", "health": "not ready (starting)"}])
    assert status.exit_code(unready) == 1
    assert status.exit_code(_snapshot(errors=["redis gone"])) == 1


def test_version_argument_is_a_non_negative_int() -> None:
    assert promotion._version("12") == 12
    for bad, message in (("x", "not 'x'"), ("-1", ">= 0")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            promotion._version(bad)


def test_gate_config_takes_the_stack_addresses_over_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIPSTREAM_BUS__URL", "nats://elsewhere:1")
    monkeypatch.setenv("SLIPSTREAM_GATE__SUITE_SIZE", "12")
    (tmp_path / "model-init").mkdir()
    (tmp_path / "model-init" / "config.json").write_text("{}")
    cfg = promotion.gate_config(_info(tmp_path), tmp_path)
    assert cfg.bus.url == "nats://127.0.0.1:4333" and cfg.service.redis_url == "redis://127.0.0.1:6399"
    assert cfg.service.run_id == "r1" and cfg.store.root == str(tmp_path / "store")
    assert cfg.gate.suite_size == 12  # gate settings come from the environment, like the service's
    assert cfg.model.path == str(tmp_path / "model-init")
    monkeypatch.setenv("SLIPSTREAM_GATE__EVERY_N_VERSIONS", "0")
    with pytest.raises(promotion.Refused, match="every_n_versions"):
        promotion.gate_config(_info(tmp_path), tmp_path)


def test_commands_without_a_stack_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(run_dir=tmp_path, version=1, reason="")
    assert promotion.run_promote(args) == 2
    assert promotion.run_rollback(args) == 2
    assert capsys.readouterr().out.count("no stack.json") == 2
