"""Weight-apply time per version, from the engine to the run summary.

The follower records one row per applied version from the engine's `stats()` (apply_ms, and wait_ms
where the engine waits for requests in flight, as VllmEngine does); the worker's /readyz lists them;
a training run reads them from each rollout worker before stopping it into `RunSummary.weight_applies`
and prints one line per worker in the summary table.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar, cast

import pytest
import torch

from slipstream.rollout_worker.follower import WeightFollower
from slipstream.run.follow import applies_line, weight_applies, worker_statuses
from slipstream.run.progress import applies_summary
from slipstream.schemas import WeightAnnounce
from slipstream.store import LocalObjectStore
from slipstream.weights import manifest_key, publish_version

pytestmark = pytest.mark.unit
RUN = "r"


class WaitingEngine:
    """Switches at once and reports, per version, the apply and wait times an engine like VllmEngine would."""

    def __init__(self) -> None:
        self.policy_version = 0
        self._stats: dict[str, float] = {"last_weight_apply_ms": 0.0, "update_wait_ms": 0.0}

    def apply_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self._stats = {"last_weight_apply_ms": 1000.0 + version, "update_wait_ms": 10.0 * version}
        if version == 2:
            self._stats["last_lora_merge_ms"] = 55.5
        self.policy_version = version

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return []

    def stats(self) -> dict[str, float]:
        return dict(self._stats)


class CopyingEngine(WaitingEngine):
    """TorchEngine's stats: an apply time and no wait."""

    def apply_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self._stats = {"last_weight_apply_ms": 2.5}
        self.policy_version = version


def _follower(tmp_path: Path, engine: Any) -> WeightFollower:
    store = LocalObjectStore(tmp_path / "store")
    for v in range(3):
        publish_version(store, run_id=RUN, version=v, tensors={"w": torch.full((8,), float(v))}, threads=1)
    return WeightFollower(cast(Any, None), store, cast(Any, engine), run_id=RUN, retries=0, backoff_s=0.0)


def _announce(v: int) -> WeightAnnounce:
    return WeightAnnounce(policy_version=v, manifest_key=manifest_key(RUN, v), run_id=RUN)


async def test_each_applied_version_leaves_its_apply_and_wait_times_in_the_status(tmp_path: Path) -> None:
    follower = _follower(tmp_path, WaitingEngine())
    assert follower.status()["weight_applies"] == []
    assert await follower.apply(_announce(1)) and await follower.apply(_announce(2))
    rows = follower.status()["weight_applies"]
    assert [(r["version"], r["apply_ms"], r["wait_ms"]) for r in rows] == [(1, 1001.0, 10.0), (2, 1002.0, 20.0)]
    assert "merge_ms" not in rows[0] and rows[1]["merge_ms"] == 55.5
    assert all(r["switch_ms"] >= 0.0 for r in rows)
    json.dumps(rows)  # /readyz serves it as JSON

    copying = _follower(tmp_path / "torch", CopyingEngine())
    assert await copying.apply(_announce(1))
    assert [(r["version"], r["apply_ms"], r["wait_ms"]) for r in copying.status()["weight_applies"]] == [(1, 2.5, None)]


class _Readyz(BaseHTTPRequestHandler):
    body: ClassVar[dict[str, Any]] = {}

    def do_GET(self) -> None:
        data = json.dumps(self.body).encode()
        self.send_response(503)  # /readyz answers 503 with its body while not ready: still read
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_run_reads_every_workers_rows_into_its_summary_and_prints_them() -> None:
    rows = [
        {"version": 1, "apply_ms": 3100.0, "wait_ms": 450.0, "switch_ms": 3600.0},
        {"version": 2, "apply_ms": 2200.0, "wait_ms": 1900.0, "switch_ms": 4100.0},
        {"version": 3, "apply_ms": 2500.0, "wait_ms": 0.0, "switch_ms": 2500.0},
    ]
    _Readyz.body = {"policy_version": 3, "weights": {"follow": "latest", "weight_applies": rows}}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Readyz)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        live = SimpleNamespace(port=port, host="127.0.0.1", alive=lambda: True)
        dead = SimpleNamespace(port=port, host="127.0.0.1", alive=lambda: False)
        stack = SimpleNamespace(services={"rollout-worker": live, "learner": live, "rollout-worker-gone": dead})
        found = weight_applies(worker_statuses(cast(Any, stack)))
    finally:
        server.shutdown()
        server.server_close()
    assert found == {"rollout-worker": rows}
    assert applies_line(rows) == "v1 3100.0 ms (wait 450.0), v2 2200.0 ms (wait 1900.0), v3 2500.0 ms (wait 0.0)"
    assert applies_line([{"version": 4, "apply_ms": 2.5, "wait_ms": None}]) == "v4 2.5 ms"
    line = applies_summary(found)
    assert line == "rollout-worker: 3 versions, apply median 2500 / max 3100 ms, wait median 450 / max 1900 ms"


def test_the_workers_follower_takes_the_configured_apply_timeout(tmp_path: Path) -> None:
    # `[worker] weight_apply_timeout_s`: how long a version may take to switch before it is counted
    # skipped; vLLM waits for every request in flight first, so a loaded run needs more than 60 s.
    from slipstream.rollout_worker.config import RolloutWorkerConfig, WorkerSection
    from slipstream.rollout_worker.service import RolloutWorkerService
    from slipstream.trust import Keyring

    assert RolloutWorkerConfig().worker.weight_apply_timeout_s == 60.0
    cfg = RolloutWorkerConfig(worker=WorkerSection(weight_apply_timeout_s=300.0))
    service = RolloutWorkerService(cfg)
    service.bus, service.store, service.engine = cast(Any, object()), LocalObjectStore(str(tmp_path)), WaitingEngine()
    assert service._follower(Keyring.parse(cfg.trust.trusted_keys), mode="latest").apply_timeout_s == 300.0
