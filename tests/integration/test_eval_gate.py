"""eval-gate, a promoted-mode weight follower and the promotion commands, on real NATS and Redis.

The tiny model warm-started for a few steps answers every held-out arith task with a clean (if
wrong) integer: reward 0.1 per task. Versions are stored with `publish_snapshot` and announced by
hand, the gate (the service object, driven in this process) judges every second version:

- v0 (the warm-started weights) is promoted: nothing to compare with, above the floor;
- v1 is not due (every_n_versions = 2): no result;
- v2 (v0 + 1e-4 noise) is not worse than v0: promoted, `weights.promoted` names v0 as previous;
- v4 (every tensor replaced by randn x 10) is rejected with a reason, no `weights.promoted`;
- a redelivered v2 announcement is not judged again.

A `follow = "promoted"` WeightFollower on its own engine applies v0 and v2 only, never v1 or v4,
and `slipstream rollback` (the command's code, against a stack.json naming these servers) moves
it back to v0; `slipstream status` reports the promoted version and stack. A second test starts
the gate with Redis down: it reports "degraded", takes no announcement, and judges it once Redis
is up on that address.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from slipstream.bus import Bus, BusConfig, connect_bus
from slipstream.control import connect_control
from slipstream.engine import build_tiny
from slipstream.engine.engine import TorchEngine
from slipstream.envs import get_env
from slipstream.eval_gate.config import EvalGateConfig, GateSection
from slipstream.eval_gate.service import EvalGateService
from slipstream.eval_gate.suite import decode_details, details_key
from slipstream.rollout_worker.follower import WeightFollower
from slipstream.runtime.section import ServiceSection
from slipstream.schemas import EvalResult, WeightAnnounce, WeightsPromoted
from slipstream.schemas.subjects import EVAL_RESULT, WEIGHTS_ANNOUNCE, WEIGHTS_PROMOTED
from slipstream.stack import Server, free_port, start_redis
from slipstream.store import LocalObjectStore, StoreConfig
from slipstream.supervised.warmstart import sft_warmstart
from slipstream.weights import publish_snapshot

pytestmark = pytest.mark.integration

RUN = "gate-itest"
Tensors = dict[str, torch.Tensor]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def warm() -> Tensors:
    """Weights that answer arith with a clean integer (reward 0.1 per task), in a few seconds."""
    torch.set_num_threads(1)
    model, tok = build_tiny("tiny", seed=0)
    sft_warmstart(model, tok, get_env("arith"), steps=15, batch_size=16, lr=3e-3, seed=0, warmup_steps=3)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _noisy(base: Tensors, scale: float, seed: int) -> Tensors:
    g = torch.Generator().manual_seed(seed)
    return {n: t + scale * torch.randn(t.shape, generator=g) for n, t in base.items()}


def _corrupted(base: Tensors, seed: int) -> Tensors:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=g) * 10 for n, t in base.items()}


def _config(nats: str, redis: str, store_root: Path) -> EvalGateConfig:
    return EvalGateConfig(
        service=ServiceSection(run_id=RUN, redis_url=redis),
        bus=BusConfig(url=nats, fetch_timeout_s=0.2),
        store=StoreConfig(type="local", root=str(store_root)),
        gate=GateSection(
            envs=["arith"], every_n_versions=2, suite_size=16, min_samples=8, floor=0.05, margin=0.05, retry_delay_s=0.3
        ),
    )


async def _publish_version(bus: Bus, store: LocalObjectStore, version: int, tensors: Tensors) -> str:
    key, _ = await asyncio.to_thread(publish_snapshot, store, run_id=RUN, version=version, tensors=tensors)
    announce = WeightAnnounce(policy_version=version, manifest_key=key, run_id=RUN, announced_at=time.time())
    await bus.publish(WEIGHTS_ANNOUNCE, announce, msg_id=f"{RUN}:announce:{version}")
    return key


async def _until(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        await asyncio.sleep(0.05)


async def _tap(bus: Bus, subject: str, cls: type[Any], into: list[Any]) -> None:
    async for d in bus.subscribe(subject, cls, deliver="all"):
        into.append(d.msg)


def _stack_json(run_dir: Path, nats: str, redis: str, store_root: Path) -> Path:
    """What `slipstream up` writes, naming the test's servers (no services)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    info = {
        "version": 1,
        "state": "ready",
        "run_id": RUN,
        "run_dir": str(run_dir),
        "servers": {"nats": {"url": nats}, "redis": {"url": redis}},
        "store": {"type": "local", "root": str(store_root), "url": "", "endpoint_url": ""},
        "services": {},
    }
    (run_dir / "stack.json").write_text(json.dumps(info))
    return run_dir


async def test_gate_promotes_rejects_noise_and_serving_follows_rollback(
    nats_server: Server,
    redis_server: Server,
    tmp_path: Path,
    warm: Tensors,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from slipstream.cli import promotion
    from slipstream.stack import status

    store_root = tmp_path / "store"
    store = LocalObjectStore(str(store_root))
    cfg = _config(nats_server.url, redis_server.url, store_root)
    gate = EvalGateService(cfg)
    await gate.setup()
    bus = await connect_bus(BusConfig(url=nats_server.url), name="itest")
    results: list[EvalResult] = []
    promotions: list[WeightsPromoted] = []
    model, tok = build_tiny("tiny", seed=1)  # serving starts from other weights: every switch is visible
    engine = TorchEngine(model, tok, max_batch=4, policy_version=-1)
    await engine.start()
    follower = WeightFollower(bus, store, engine, run_id=RUN, retries=0, backoff_s=0.1, mode="promoted")
    stop = asyncio.Event()
    jobs = [
        asyncio.create_task(gate.run(stop)),
        asyncio.create_task(follower.run(stop)),
        asyncio.create_task(_tap(bus, EVAL_RESULT, EvalResult, results)),
        asyncio.create_task(_tap(bus, WEIGHTS_PROMOTED, WeightsPromoted, promotions)),
    ]
    try:
        key0 = await _publish_version(bus, store, 0, warm)
        await _until(lambda: len(promotions) == 1, 60, "v0 promoted")
        assert [r.policy_version for r in results] == [0]
        assert results[0].decision == "promote" and results[0].baseline_version is None
        assert results[0].score == pytest.approx(0.1) and results[0].n_samples == 16
        assert (promotions[0].policy_version, promotions[0].previous_version) == (0, None)
        assert promotions[0].manifest_key == key0
        await _until(lambda: engine.policy_version == 0, 20, "serving follower on v0")

        await _publish_version(bus, store, 1, _noisy(warm, 1e-4, 1))  # not due: every second version
        await _publish_version(bus, store, 2, _noisy(warm, 1e-4, 2))
        await _until(lambda: len(promotions) == 2, 60, "v2 promoted")
        assert [r.policy_version for r in results] == [0, 2]
        v2 = results[1]
        assert v2.decision == "promote" and v2.baseline_version == 0 and v2.baseline_score == pytest.approx(0.1)
        assert "diff vs promoted v0" in v2.reason
        assert (promotions[1].policy_version, promotions[1].previous_version) == (2, 0)
        await _until(lambda: engine.policy_version == 2, 20, "serving follower on v2")

        await _publish_version(bus, store, 4, _corrupted(warm, 4))
        await _until(lambda: len(results) == 3, 60, "v4 judged")
        v4 = results[2]
        assert v4.policy_version == 4 and v4.decision == "reject"
        assert v4.score < 0.05 and v4.reason.startswith("below floor"), v4.reason
        assert v4.baseline_version == 2

        # A redelivered announcement of a judged version is acked without a second judgement.
        await bus.publish(
            WEIGHTS_ANNOUNCE,
            WeightAnnounce(policy_version=2, manifest_key=promotions[1].manifest_key, run_id=RUN),
            msg_id=f"{RUN}:announce:2:again",
        )
        assert gate.intake is not None
        await _until(lambda: gate.intake is not None and gate.intake.outcomes["already_judged"] == 1, 20, "re-announce")
        await asyncio.sleep(0.5)
        assert len(results) == 3 and len(promotions) == 2
        assert gate.intake.outcomes["not_due"] == 1

        async with await connect_control(redis_server.url, RUN) as control:
            assert await control.evals.promoted() == 2
            assert await control.evals.promotion_stack() == [0, 2]
            assert [r.policy_version for r in await control.evals.history()] == [0, 2, 4]
        details = decode_details(store.get(details_key(RUN, 4, "heldout")))
        assert details.decision == "reject" and len(details.tasks) == 16 and details.baseline_version == 2
        assert decode_details(store.get(details_key(RUN, 2, "heldout"))).scores == pytest.approx([0.1] * 16)

        # The operator's commands, through a stack.json naming these servers.
        run_dir = _stack_json(tmp_path / "run", nats_server.url, redis_server.url, store_root)
        snapshot = await status.collect(status.load_stack(run_dir), timeout_s=3.0)
        assert snapshot["versions"]["promoted"] == 2 and snapshot["versions"]["promotion_stack"] == [0, 2]
        assert snapshot["versions"]["latest"] == 2  # the re-announce is the newest weights.announce
        assert snapshot["versions"]["last_eval"]["decision"] == "reject"
        weights = next(s for s in snapshot["streams"] if s["name"] == "WEIGHTS")
        assert weights["messages"] == 7  # 5 announcements + 2 promotions
        assert weights["consumers"]["eval-gate"] == {"pending": 0, "ack_pending": 0}
        assert snapshot["dlq"]["WEIGHTS"] == 0

        # `slipstream eval` judges in this process with the gate's settings (here from the environment), dry.
        for name, value in {"SUITE_SIZE": "16", "MIN_SAMPLES": "8", "FLOOR": "0.05", "EVERY_N_VERSIONS": "2"}.items():
            monkeypatch.setenv(f"SLIPSTREAM_GATE__{name}", value)
        capsys.readouterr()
        dry = argparse.Namespace(run_dir=run_dir, version=4, publish=False, config=None, model_path=None, json=True)
        assert await asyncio.to_thread(promotion.run_eval, dry) == 0
        shown = json.loads(capsys.readouterr().out)
        assert shown["result"]["decision"] == "reject" and shown["result"]["baseline_version"] == 2
        assert shown["result"]["reason"] == v4.reason and shown["published"] is False
        assert shown["diff"]["mean"] == pytest.approx(-0.1)
        await asyncio.sleep(0.3)
        assert len(results) == 3  # a dry run publishes nothing

        rollback = argparse.Namespace(run_dir=run_dir, reason="bad canary")
        assert await asyncio.to_thread(promotion.run_rollback, rollback) == 0
        await _until(lambda: len(promotions) == 3, 10, "rollback announced")
        back = promotions[2]
        assert (back.policy_version, back.previous_version, back.reason) == (0, 2, "rollback: bad canary")
        await _until(lambda: engine.policy_version == 0, 10, "serving follower back on v0")
        # Nothing left to roll back to, and a version without a manifest cannot be promoted.
        assert await asyncio.to_thread(promotion.run_rollback, rollback) == 1
        missing = argparse.Namespace(run_dir=run_dir, version=99, reason="")
        assert await asyncio.to_thread(promotion.run_promote, missing) == 1
        again = argparse.Namespace(run_dir=run_dir, version=2, reason="canary fixed")
        assert await asyncio.to_thread(promotion.run_promote, again) == 0
        # The follower records a version in its history after the engine has it: wait for both.
        await _until(
            lambda: engine.policy_version == 2 and len(follower.history) == 4, 10, "serving follower on v2 again"
        )
        assert list(follower.history) == [0, 2, 0, 2]  # never v1 (not promoted) nor v4 (rejected)
        assert follower.status()["follow"] == "promoted" and follower.failures == 0

        # A forged announce far ahead (no manifest, due) is refused and acked, never judged.
        await bus.publish(
            WEIGHTS_ANNOUNCE,
            WeightAnnounce(policy_version=1000, manifest_key="weights/forged/manifest.json", run_id=RUN),
            msg_id=f"{RUN}:forged:1000",
        )
        await _until(lambda: gate.intake.outcomes["refused_missing_manifest"] == 1, 20, "the forgery refused")
        assert gate.status()["announces"]["refused"] == {"missing_manifest": 1}
        await asyncio.sleep(0.3)
        assert len(results) == 3 and gate.gate is not None and gate.gate.evaluating is None
    finally:
        stop.set()
        for tap in jobs[2:]:  # the taps read until cancelled
            tap.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        await engine.stop()
        await gate.close()
        await bus.close()


async def test_gate_waits_for_redis_and_loses_nothing(nats_server: Server, tmp_path: Path, warm: Tensors) -> None:
    store_root = tmp_path / "store"
    store = LocalObjectStore(str(store_root))
    port = free_port()
    cfg = _config(nats_server.url, f"redis://127.0.0.1:{port}", store_root)
    gate = EvalGateService(cfg)
    await gate.setup()  # Redis is not there: setup still succeeds
    assert gate.ready()
    assert gate.status()["control"]["redis"] == "degraded"
    bus = await connect_bus(BusConfig(url=nats_server.url), name="itest")
    results: list[EvalResult] = []
    stop = asyncio.Event()
    run = asyncio.create_task(gate.run(stop))
    tap = asyncio.create_task(_tap(bus, EVAL_RESULT, EvalResult, results))
    redis: Server | None = None
    try:
        await _publish_version(bus, store, 0, warm)
        await asyncio.sleep(1.5)
        info = await bus.stream_info("WEIGHTS")
        # Not fetched while Redis is away: no delivery used up, nothing judged.
        assert info["consumers"]["eval-gate"] == {
            "num_pending": 1,
            "num_ack_pending": 0,
            "num_redelivered": 0,
            "num_waiting": info["consumers"]["eval-gate"]["num_waiting"],
        }
        assert results == [] and gate.status()["control"]["redis"] == "degraded"
        redis = start_redis(tmp_path / "redis", tmp_path / "logs", port=port)
        await _until(lambda: len(results) == 1, 30, "v0 judged after Redis came up")
        assert results[0].decision == "promote"
        assert gate.status()["control"]["redis"] == "ok"
        async with await connect_control(redis.url, RUN) as control:
            assert await control.evals.promoted() == 0
    finally:
        stop.set()
        tap.cancel()
        await asyncio.gather(run, tap, return_exceptions=True)
        await gate.close()
        await bus.close()
        if redis is not None:
            redis.stop()
