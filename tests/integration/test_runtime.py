"""The service runtime, end to end: real processes, real signals, real probes, real exit codes.

Services run as child processes (started with their PIDs tracked, stopped by PID) on port 0,
found through `--service.port-file`. The happy path runs the five real services against a
nats-server started by the test; the failure paths use `runtime_scripts/lifecycle_service.py`,
which goes through the same `service_main` without needing a bus.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from slipstream.runtime import BaseService, ServiceSection
from slipstream.runtime.lifecycle import Runtime, State
from slipstream.stack import ManagedProcess, Server, free_port

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parent / "runtime_scripts" / "lifecycle_service.py"
SERVICES = {
    "rollout-worker": "slipstream.rollout_worker",
    "reward-model": "slipstream.reward_model",
    "learner": "slipstream.learner",
    "weight-publisher": "slipstream.weight_publisher",
    "eval-gate": "slipstream.eval_gate",
    "task-source": "slipstream.task_source",
}
HAPPY_STATES = ["starting", "ready", "running", "draining", "stopped"]


def child_env() -> dict[str, str]:
    # The children get no SLIPSTREAM_*/OTEL_* from whoever runs the tests: only their flags count.
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLIPSTREAM_", "OTEL_"))}


class ServiceProcess:
    """One service child process and what the tests ask of it."""

    def __init__(self, name: str, argv: list[str], tmp_path: Path) -> None:
        self.name = name
        self.port_file = tmp_path / "ports" / name
        argv = [*argv, "--service.port-file", str(self.port_file), "--service.replica", f"{name}-0"]
        self.proc = ManagedProcess(name, argv, tmp_path / "logs" / f"{name}.log", env=child_env())
        self.port = 0

    def wait_port(self, timeout_s: float = 20.0) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.port_file.exists() and (text := self.port_file.read_text().strip()):
                self.port = int(text)
                return self.port
            if not self.proc.alive():
                pytest.fail(f"{self.name} exited with {self.proc.proc.returncode} before listening:\n{self.tail()}")
            time.sleep(0.02)
        pytest.fail(f"{self.name} wrote no port file in {timeout_s}s:\n{self.tail()}")

    def get(self, path: str) -> tuple[int, str, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.getheader("Content-Type", ""), resp.read()
        finally:
            conn.close()

    def wait_ready(self, timeout_s: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                status, _, body = self.get("/readyz")
            except TimeoutError:  # a probe slower than 5 s on a busy machine: ask again
                continue
            if status == 200:
                return dict(json.loads(body))
            if not self.proc.alive():
                break
            time.sleep(0.05)
        pytest.fail(f"{self.name} never became ready:\n{self.tail()}")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        os.kill(self.proc.pid, sig)

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.proc.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name} still running {timeout_s}s after SIGTERM:\n{self.tail()}")

    def logs(self) -> list[dict[str, Any]]:
        out = []
        for line in self.proc.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                out.append(json.loads(line))
        return out

    def states(self) -> list[str]:
        return [rec["state"] for rec in self.logs() if rec.get("event") == "state"]

    def wait_log(self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for rec in self.logs():
                if predicate(rec):
                    return rec
            time.sleep(0.05)
        pytest.fail(f"{self.name}: expected log line not seen:\n{self.tail()}")

    def tail(self) -> str:
        return self.proc.tail(30)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[[str, list[str]], ServiceProcess]]:
    started: list[ServiceProcess] = []

    def _spawn(name: str, argv: list[str]) -> ServiceProcess:
        sp = ServiceProcess(name, argv, tmp_path)
        started.append(sp)
        return sp

    yield _spawn
    for sp in started:
        sp.proc.stop(timeout_s=5)


def lifecycle(spawn: Callable[[str, list[str]], ServiceProcess], *args: str) -> ServiceProcess:
    return spawn("lifecycle-test", [sys.executable, str(SCRIPT), *args])


async def stream_names(url: str) -> list[str]:
    import nats

    nc = await nats.connect(url)
    try:
        return sorted([s.config.name for s in await nc.jetstream().streams_info()])
    finally:
        await nc.close()


async def test_reward_model_probes_metrics_and_clean_sigterm(
    nats_server: Server, spawn: Callable[[str, list[str]], ServiceProcess]
) -> None:
    drain_budget = 5.0
    svc = spawn(
        "reward-model",
        [sys.executable, "-m", "slipstream.reward_model", "--bus.url", nats_server.url,
         "--service.drain-timeout-s", str(drain_budget)],
    )  # fmt: skip
    svc.wait_port()
    assert svc.get("/healthz")[0] == 200
    body = svc.wait_ready()
    assert body["state"] == "running" and body["ready"] is True
    assert body["service"] == "reward-model" and body["replica"] == "reward-model-0"
    assert body["status"]["bus"] == {"type": "nats", "connected": True}
    # setup provisioned the streams of the subject table on the server.
    assert {"TASKS", "TRAJ_RAW", "TRAJ_SCORED", "WEIGHTS", "DLQ"} <= set(await stream_names(nats_server.url))

    status, ctype, metrics = svc.get("/metrics")
    assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
    text = metrics.decode()
    assert 'reward_model_runtime_state{state="running"} 1' in text
    assert 'reward_model_runtime_state{state="starting"} 0' in text
    uptime = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("reward_model_runtime_uptime_s")]
    assert len(uptime) == 1 and uptime[0] > 0
    assert svc.get("/nope")[0] == 404

    t0 = time.monotonic()
    svc.signal(signal.SIGTERM)
    assert svc.wait_exit(drain_budget + 5) == 0
    assert time.monotonic() - t0 < drain_budget
    assert svc.states() == HAPPY_STATES
    listening = [r for r in svc.logs() if r.get("event") == "http listening"]
    assert len(listening) == 1 and listening[0]["port"] == svc.port
    assert all(r["service"] == "reward-model" and r["replica"] == "reward-model-0" for r in svc.logs())
    assert not svc.port_file.exists()


def test_every_service_becomes_ready_and_stops_with_0(
    nats_server: Server, redis_server: Server, spawn: Callable[[str, list[str]], ServiceProcess]
) -> None:
    common = ["--bus.url", nats_server.url, "--service.redis-url", redis_server.url]
    procs = [spawn(name, [sys.executable, "-m", module, *common]) for name, module in SERVICES.items()]
    for sp in procs:
        sp.wait_port()
        assert sp.wait_ready()["service"] == sp.name
    for sp in procs:
        sp.signal(signal.SIGTERM)
    assert {sp.name: sp.wait_exit(15) for sp in procs} == dict.fromkeys(SERVICES, 0)
    assert {sp.name: sp.states() for sp in procs} == dict.fromkeys(SERVICES, HAPPY_STATES)


def test_setup_failure_exits_1_with_its_cause_and_never_ready(
    spawn: Callable[[str, list[str]], ServiceProcess],
) -> None:
    svc = lifecycle(spawn, "--probe.mode", "setup_fails", "--probe.setup-delay-s", "1.0")
    svc.wait_port()
    seen: list[int] = []
    while svc.proc.alive():
        try:
            seen.append(svc.get("/readyz")[0])
        except OSError:
            break  # the listener is gone: the process is on its way out
        time.sleep(0.05)
    assert svc.wait_exit(10) == 1
    assert 503 in seen and 200 not in seen
    assert svc.states() == ["starting", "failed"]
    (failure,) = [r for r in svc.logs() if r.get("event") == "setup failed"]
    assert "RuntimeError: setup exploded: fake dependency unreachable" in failure["exception"]
    assert "ConnectionRefusedError: nothing listens on the fake dependency" in failure["exception"]


def test_real_service_without_its_bus_fails_setup_with_exit_1(
    spawn: Callable[[str, list[str]], ServiceProcess],
) -> None:
    dead = f"nats://127.0.0.1:{free_port()}"
    redis = "redis://127.0.0.1:6/0"  # never contacted: the bus is set up first and fails
    svc = spawn(
        "eval-gate",
        [sys.executable, "-m", "slipstream.eval_gate", "--bus.url", dead, "--bus.connect-budget-s", "1",
         "--service.redis-url", redis],
    )  # fmt: skip
    svc.wait_port()
    status, _, body = svc.get("/readyz")
    assert status == 503 and json.loads(body)["state"] == "starting"
    assert svc.get("/healthz")[0] == 200  # liveness does not depend on NATS
    assert svc.wait_exit(20) == 1
    assert svc.states() == ["starting", "failed"]
    (failure,) = [r for r in svc.logs() if r.get("event") == "setup failed"]
    assert "BusUnavailable" in failure["exception"]


def test_run_failure_exits_1_and_is_logged(spawn: Callable[[str, list[str]], ServiceProcess]) -> None:
    svc = lifecycle(spawn, "--probe.mode", "run_fails")
    assert svc.wait_exit(10) == 1
    assert svc.states() == ["starting", "ready", "running", "failed"]
    (failure,) = [r for r in svc.logs() if r.get("event") == "run failed"]
    assert "ValueError: run exploded on purpose" in failure["exception"]


def test_in_flight_work_past_the_drain_budget_exits_3_naming_the_count(
    spawn: Callable[[str, list[str]], ServiceProcess],
) -> None:
    svc = lifecycle(spawn, "--probe.mode", "slow_drain", "--probe.in-flight", "3", "--service.drain-timeout-s", "0.5")
    svc.wait_port()
    assert svc.wait_ready()["status"] == {"mode": "slow_drain", "in_flight": 3}
    t0 = time.monotonic()
    svc.signal(signal.SIGTERM)
    assert svc.wait_exit(10) == 3
    assert 0.5 <= time.monotonic() - t0 < 5.0
    (incomplete,) = [r for r in svc.logs() if r.get("event") == "drain incomplete: closing with work in flight"]
    assert incomplete["in_flight"] == 3 and incomplete["forced"] is False
    assert incomplete["level"] == "error"
    assert svc.states() == HAPPY_STATES


def test_second_sigterm_during_drain_forces_close(spawn: Callable[[str, list[str]], ServiceProcess]) -> None:
    svc = lifecycle(spawn, "--probe.mode", "slow_drain", "--probe.in-flight", "2", "--service.drain-timeout-s", "60")
    svc.wait_port()
    svc.wait_ready()
    svc.signal(signal.SIGTERM)
    svc.wait_log(lambda r: r.get("state") == "draining")
    status, _, body = svc.get("/readyz")
    assert status == 503 and json.loads(body)["state"] == "draining"
    assert svc.get("/healthz")[0] == 200
    t0 = time.monotonic()
    svc.signal(signal.SIGTERM)
    assert svc.wait_exit(10) == 3
    assert time.monotonic() - t0 < 5.0  # far inside the 60 s budget
    (incomplete,) = [r for r in svc.logs() if r.get("event") == "drain incomplete: closing with work in flight"]
    assert incomplete["in_flight"] == 2 and incomplete["forced"] is True


class RecordingService(BaseService):
    """In-process service that records the hooks the runtime calls, in order."""

    name = "inproc-test"

    def __init__(self, *, setup_hangs: bool = False, drain_raises: bool = False) -> None:
        self.calls: list[str] = []
        self.setup_hangs = setup_hangs
        self.drain_raises = drain_raises

    async def setup(self) -> None:
        self.calls.append("setup")
        if self.setup_hangs:
            await asyncio.Event().wait()

    async def run(self, stop: asyncio.Event) -> None:
        self.calls.append("run")
        await stop.wait()
        self.calls.append("run returned")

    async def drain(self) -> None:
        self.calls.append("drain")
        if self.drain_raises:
            raise OSError("could not hand back 2 messages")

    async def close(self) -> None:
        self.calls.append("close")


async def _until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_in_process_hooks_run_in_order_and_drain_errors_fail_the_exit() -> None:
    svc = RecordingService()
    rt = Runtime(svc, ServiceSection(drain_timeout_s=2.0), replica="r0")
    task = asyncio.create_task(rt.run(handle_signals=False))
    await _until(lambda: rt.state is State.RUNNING)
    assert rt.readiness()[0] is True and rt.port > 0
    rt.request_stop("test")
    assert await task == 0
    assert svc.calls == ["setup", "run", "run returned", "drain", "close"]
    assert rt.state is State.STOPPED and rt.readiness()[0] is False

    failing = RecordingService(drain_raises=True)
    rt = Runtime(failing, ServiceSection(drain_timeout_s=2.0), replica="r1")
    task = asyncio.create_task(rt.run(handle_signals=False))
    await _until(lambda: rt.state is State.RUNNING)
    rt.request_stop("test")
    assert await task == 1
    assert failing.calls[-2:] == ["drain", "close"]  # close still runs after a failed drain
    assert rt.state is State.FAILED and rt.healthy() is False


async def test_in_process_stop_during_setup_skips_run_and_closes() -> None:
    svc = RecordingService(setup_hangs=True)
    rt = Runtime(svc, ServiceSection(), replica="r2")
    task = asyncio.create_task(rt.run(handle_signals=False))
    await _until(lambda: svc.calls == ["setup"])
    assert rt.readiness()[0] is False and rt.state is State.STARTING
    rt.request_stop("test")
    assert await asyncio.wait_for(task, 5) == 0
    assert svc.calls == ["setup", "close"]
    assert rt.state is State.STOPPED


def _help_run(module: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", module, "--help"],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=60,
    )


# What makes `--help` (and a config error) slow: the model and retrieval stacks (seconds each;
# numpy, a fifth of a second, comes in with the environments' registry). How fast it is on a given
# machine is a benchmark's question; that it never loads these is this test's.
HEAVY = ("torch", "transformers", "ray", "vllm", "bm25s", "scipy", "sklearn")


@pytest.mark.parametrize("module", SERVICES.values())
def test_help_does_not_import_the_model_stack(module: str) -> None:
    out = _help_run(module)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--bus.url" in out.stdout and "SLIPSTREAM_SERVICE__DRAIN_TIMEOUT_S" in out.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    assert len(imported) > 50  # importtime really reported
    assert [m for m in imported if m.split(".")[0] in HEAVY] == []
