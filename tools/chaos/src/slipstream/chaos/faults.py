"""The faults of `slipstream chaos` (suite.py) and how each is applied to a live local stack.

`Chaos` follows the learner's steps and applies the schedule one fault after another, each
`gap` steps after the previous one settled, recording when and what came of it (`FaultRecord`);
the small NATS reads it needs (dead-letter counts, stream sequences) and the forged announces'
publish live here too. What the suite concludes from the run's records is audit.py's.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slipstream.chaos.audit import IMPOSTOR_VERSION, applied_versions, refused_versions

PIPELINE_KILLS = ("rollout-worker", "reward-model", "learner", "weight-publisher", "task-source")
# The shard corruption goes early: it needs a version right before a keyframe still to come.
FAULTS: tuple[str, ...] = (
    "inject",
    "corrupt",
    *(f"kill:{s}" for s in PIPELINE_KILLS),
    "forge",
    "restart:nats",
    "restart:redis",
    "permission",
    "stop:tool-service",
)
AHEAD = 1000
"""How far ahead of the newest real version the forged announces point."""


def env_tools(env: str, options: dict[str, Any]) -> list[str]:
    """The names of the tools `env` calls through its transport (in-process, or a tool-service replica); [] if none."""
    from slipstream.envs import get_env

    registry = getattr(get_env(env, **options), "registry", None)
    return list(registry.names) if registry is not None else []


@dataclass
class FaultRecord:
    """One fault of the schedule: when it was applied and what came of it."""

    name: str
    at_step: int = -1
    t_s: float = -1.0
    """Seconds since the suite started."""
    at: float = 0.0
    """Wall-clock time (time.time())."""
    ok: bool = False
    outcome: str = "not reached (the run ended first)"
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "at_step": self.at_step,
            "t_s": round(self.t_s, 2),
            "at": round(self.at, 3),
            "ok": self.ok,
            "outcome": self.outcome,
            "detail": self.detail,
        }


class FaultFailed(RuntimeError):
    """A fault was applied but the system did not show what it must (the message says what)."""


async def _until(cond: Callable[[], bool], timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise FaultFailed(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(0.2)
    return time.monotonic() - t0


class Chaos:
    """Drives the schedule inside the run's own event loop (started at the learner's first step)."""

    def __init__(
        self, plan: Any, faults: list[str], *, gap: int, first_at: int, log: Callable[[str], None] = print
    ) -> None:
        self.plan = plan
        self.records = [FaultRecord(name) for name in faults]
        self.gap = gap
        self.first_at = first_at
        self.log = log
        self.t0 = time.monotonic()
        self.steps = 0
        self.stack: Any = None
        self.tap: Any = None
        self.task: asyncio.Task[None] | None = None
        self.poller: asyncio.Task[None] | None = None
        self.injected: dict[str, int] = {}
        self.corrupted: dict[int, float] = {}

    # -- run_training's hooks ----------------------------------------------------------------------
    def on_stack(self, stack: Any) -> None:
        self.stack = stack

    def on_tap(self, tap: Any) -> None:
        self.tap = tap

    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "step":
            self.steps = max(self.steps, int(data["step"]))
            if self.steps % 5 == 0:
                self.log(f"step {self.steps}: reward {data['reward']:.2f}, trajectories {data['trajectories']}")
            if self.task is None and self.stack is not None:
                loop = asyncio.get_running_loop()
                self.task = loop.create_task(self._drive())
                self.poller = loop.create_task(self._poll_steps())
        elif kind == "supervisor":
            self.log(f"supervisor: {data['service']} {data['kind']} {data.get('detail', '')}".rstrip())
        elif kind == "phase":
            self.log(f"{data['phase']}: {data.get('detail', '')}")

    # -- the schedule --------------------------------------------------------------------------------
    async def _poll_steps(self) -> None:
        """The learner's step from its /readyz too: the bus view pauses while NATS restarts."""
        from slipstream.stack.status import read_json

        while True:
            svc = self.stack.services.get("learner")
            if svc is not None and svc.alive():
                _, body = await asyncio.to_thread(read_json, svc.port, "/readyz", 1.0, svc.host)
                step = ((body or {}).get("status") or {}).get("step")
                if isinstance(step, int):
                    self.steps = max(self.steps, step)
            await asyncio.sleep(1.0)

    async def _drive(self) -> None:
        tools = [n for n in self.stack.services if n.startswith("tool-service")]
        for rec in self.records:
            if rec.name == "stop:tool-service" and len(tools) < 2:
                rec.at_step, rec.t_s, rec.at, rec.ok = self.steps, time.monotonic() - self.t0, time.time(), True
                rec.outcome = (
                    f"not applicable: {len(tools)} tool-service replica(s) here (needs 2: --env lookup or search)"
                )
                rec.detail = {"replicas": len(tools), "applicable": False}
        at = self.first_at
        for rec in self.records:
            if rec.ok:
                continue
            while self.steps < at:
                await asyncio.sleep(0.2)
            rec.at_step, rec.t_s, rec.at = self.steps, time.monotonic() - self.t0, time.time()
            self.log(f"fault {rec.name} at step {rec.at_step} ({rec.t_s:.0f} s)")
            try:
                rec.outcome = await self._apply(rec)
                rec.ok = True
            except asyncio.CancelledError:
                rec.outcome = "cut short: the run ended while it was in progress"
                raise
            except Exception as exc:
                rec.outcome = f"failed: {exc}"
            self.log(f"fault {rec.name}: {'ok' if rec.ok else 'FAILED'}: {rec.outcome}")
            at = self.steps + self.gap

    async def _apply(self, rec: FaultRecord) -> str:
        kind, _, arg = rec.name.partition(":")
        if kind == "inject":
            return await self._inject(rec)
        if kind == "kill":
            return await self._kill(arg, rec)
        if kind == "forge":
            return await self._forge(rec)
        if kind == "restart":
            return await self._restart(arg, rec)
        if kind == "corrupt":
            return await self._corrupt(rec)
        if kind == "permission":
            return await self._permission(rec)
        return await self._stop_tool_service(rec)

    async def _next_steps(self, n: int, timeout_s: float) -> float:
        target = self.steps + n
        return await _until(lambda: self.steps >= target, timeout_s, f"learner step {target}")

    async def _ready(self, name: str, timeout_s: float) -> float:
        from slipstream.stack.probe import probe_http

        svc = self.stack.services[name]
        t0 = time.monotonic()
        while True:
            if svc.alive() and await asyncio.to_thread(probe_http, svc.port, "/readyz", svc.host, 0.5) == 200:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise FaultFailed(f"{name} not ready {timeout_s:.0f} s after its restart")
            await asyncio.sleep(0.3)

    async def _kill(self, name: str, rec: FaultRecord) -> str:
        svc = self.stack.services.get(name)
        if svc is None:
            raise FaultFailed(f"no {name} in this stack")
        before = self.stack.supervisor.restarts(name)
        pid = svc.pid
        os.kill(pid, signal.SIGKILL)
        back = await _until(lambda: self.stack.supervisor.restarts(name) > before, 120, f"{name}'s restart")
        ready = await self._ready(name, 240)
        rec.detail = {"pid": pid, "new_pid": svc.pid, "restarted_after_s": round(back, 2)}
        rec.detail["ready_after_s"] = round(ready, 2)
        return f"SIGKILL pid {pid}; restarted after {back:.1f} s (pid {svc.pid}), ready {ready:.1f} s later"

    async def _inject(self, rec: FaultRecord) -> str:
        import nats

        from slipstream.schemas import SCHEMA_HEADER
        from slipstream.schemas.subjects import SUBJECTS, tool_subject

        nc = await nats.connect(
            self.stack.servers["nats"].url, name="chaos-outsider", **self.stack.admin_nats_options()
        )
        try:
            js = nc.jetstream()
            limit = nc.max_payload
            for spec in SUBJECTS:
                if spec.stream == "DLQ":
                    continue
                subject = spec.pattern.replace(">", self.plan.env).replace("*", self.plan.env)
                bodies: list[tuple[bytes, dict[str, str] | None]] = [
                    (b"\xc1 not msgpack", None),
                    (b"\x80", {SCHEMA_HEADER: f"{spec.message}/99"}),
                    (b"\xc1" * (limit - 64), None),  # fits the bus; its dead letter would not
                ]
                for body, headers in bodies:
                    await js.publish(subject, body, headers=headers)
                self.injected[subject] = len(bodies)
            tools = [n for n in self.stack.services if n.startswith("tool-service")]
            if tools:
                try:
                    subject = tool_subject(env_tools(self.plan.env, self.plan.env_options)[0])
                    reply = await nc.request(subject, b"\xc1 garbage", timeout=5)
                    rec.detail["tool_request"] = f"{subject} answered ({len(reply.data)} bytes)"
                except Exception as exc:
                    rec.detail["tool_request"] = f"no answer: {exc!r}"
        finally:
            await nc.close()
        want = {"TASKS": 3, "TRAJ_RAW": 3, "TRAJ_SCORED": 3}
        got: dict[str, int] = {}

        async def count() -> None:
            got.update(await _dlq_counts(self.stack))

        deadline = time.monotonic() + 90
        while True:
            await count()
            if all(got.get(s, 0) >= n for s, n in want.items()):
                break
            if time.monotonic() > deadline:
                raise FaultFailed(f"dead letters after 90 s: {got}, wanted at least {want}")
            await asyncio.sleep(1.0)
        rec.detail.update({"injected": dict(self.injected), "dead_letters": got})
        return f"{sum(self.injected.values())} messages on {len(self.injected)} subjects; dead letters {got}"

    async def _forge(self, rec: FaultRecord) -> str:
        import msgspec

        from slipstream.schemas import WeightAnnounce, to_json
        from slipstream.stack.status import read_json
        from slipstream.store import LocalObjectStore
        from slipstream.weights import manifest_key, read_manifest
        from slipstream.weights.chain import latest_version

        run_id = self.stack.spec.run_id
        store = LocalObjectStore(self.stack.spec.store.root)
        newest = latest_version(store, run_id)
        if newest is None:
            raise FaultFailed("no version stored yet")
        real = read_manifest(store, manifest_key(run_id, newest))
        far = newest + AHEAD
        # Outside the run's version layout, so nothing that lists versions ever takes it for one.
        unsigned_key = f"chaos/{run_id}/unsigned/manifest.json"
        store.put(unsigned_key, to_json(msgspec.structs.replace(real, policy_version=far + 2, key_id="", ed25519="")))
        announces = {
            "missing_manifest": WeightAnnounce(
                policy_version=far, manifest_key=manifest_key(run_id, far), run_id=run_id, fence_token=real.fence_token
            ),
            "fence": WeightAnnounce(
                policy_version=newest,
                manifest_key=manifest_key(run_id, newest),
                run_id=run_id,
                fence_token=real.fence_token + AHEAD,
            ),
            "unsigned": WeightAnnounce(
                policy_version=far + 2, manifest_key=unsigned_key, run_id=run_id, fence_token=real.fence_token
            ),
        }
        worker = self.stack.services["rollout-worker"]

        def refused() -> dict[str, int]:
            _, body = read_json(worker.port, "/readyz", 1.0, worker.host)
            status = (body or {}).get("status") or {}
            return dict((((status.get("weights") or {}).get("announces") or {}).get("refused")) or {})

        before = await asyncio.to_thread(refused)
        await _publish_announces(self.stack, announces)
        seen: dict[str, int] = {}

        def all_refused() -> bool:
            seen.clear()
            seen.update(refused())
            return all(seen.get(r, 0) > before.get(r, 0) for r in announces)

        t0 = time.monotonic()
        while not await asyncio.to_thread(all_refused):
            if time.monotonic() - t0 > 60:
                raise FaultFailed(f"the worker's refusals after 60 s: {seen} (before {before})")
            await asyncio.sleep(0.5)
        rec.detail = {"newest_real_version": newest, "forged": sorted(announces), "worker_refused": dict(seen)}
        source = self.stack.services.get("task-source")
        if source is not None:
            _, body = await asyncio.to_thread(read_json, source.port, "/readyz", 1.0, source.host)
            st = (body or {}).get("status") or {}
            rec.detail["task_source_refused"] = dict(((st.get("announces") or {}).get("refused")) or {})
        took = await self._next_steps(self.gap, 240)
        return f"3 forged announces refused by the worker ({seen}); training moved {self.gap} steps in {took:.1f} s"

    async def _restart(self, name: str, rec: FaultRecord) -> str:
        before = await _stream_seqs(self.stack) if name == "nats" else {}
        # On this (the main) thread, in one go: nothing polls the server while it is down.
        down = self.stack.restart_server(name, empty=name == "redis")
        detail: dict[str, Any] = {"down_s": round(down, 2)}
        if name == "redis":
            import redis.asyncio as aioredis

            client = aioredis.from_url(self.stack.admin_redis_url())
            try:
                detail["keys_after_restart"] = int(await client.dbsize())
            finally:
                await client.aclose()
        took = await self._next_steps(2, 300)
        if name == "nats":
            after = await _stream_seqs(self.stack)
            detail["last_seq_before"], detail["last_seq_after"] = before, after
            shrunk = [s for s, n in before.items() if after.get(s, 0) < n]
            if shrunk:
                raise FaultFailed(f"streams lost messages across the restart: {shrunk} ({before} -> {after})")
        rec.detail = {**detail, "two_steps_after_s": round(took, 1)}
        how = "empty" if name == "redis" else "on its JetStream store"
        return f"{name} down {down:.2f} s, back {how}; two more learner steps {took:.1f} s later"

    async def _corrupt(self, rec: FaultRecord) -> str:
        """Flip bytes in a shard of version V after it is stored and before any worker fetches it.

        V is a version right before a keyframe, so the workers that refuse it jump to the keyframe
        after it (a refused delta would otherwise block every delta built on it). The publisher is
        paused once V-1 is out; when the learner has staged V, the learner and the workers are
        paused too and the publisher resumed; once V's manifest is stored its first shard is
        corrupted and the workers resumed (then the learner): they must refuse V on its sha256.
        """
        from slipstream.store import LocalObjectStore
        from slipstream.weights import DEFAULT_KEYFRAME_EVERY, manifest_key, read_manifest
        from slipstream.weights.chain import latest_version
        from slipstream.weights.layout import shard_key
        from slipstream.weights.staging import list_staged

        run_id = self.stack.spec.run_id
        root = Path(self.stack.spec.store.root)
        store = LocalObjectStore(root)
        staging = Path(self.stack.spec.run_dir) / "staging"
        every = int(os.environ.get("SLIPSTREAM_PUBLISHER__KEYFRAME_EVERY", DEFAULT_KEYFRAME_EVERY))
        services = self.stack.services
        publisher, learner = services["weight-publisher"], services["learner"]
        workers = [s for n, s in services.items() if n.startswith("rollout-worker")]

        def newest() -> int:
            return latest_version(store, run_id) or 0

        def reached(v: int) -> Callable[[], bool]:
            return lambda: newest() >= v

        def staged(v: int) -> Callable[[], bool]:
            return lambda: any(s.version >= v for s in list_staged(staging))

        def stored(v: int) -> Callable[[], bool]:
            return lambda: store.exists(manifest_key(run_id, v))

        logs = [Path(w.process.log_path) for w in workers]

        def refused(v: int) -> Callable[[], bool]:
            return lambda: any(v in refused_versions(p) for p in logs)

        def passed(v: int) -> Callable[[], bool]:
            return lambda: any(a > v for p in logs for a, _ in applied_versions(p))

        attempts: list[str] = []
        while True:
            target = newest() + 1
            while (target + 1) % every:
                target += 1
            if target + 1 > self.plan.max_steps:
                raise FaultFailed(f"no version before a keyframe left to corrupt (tried: {'; '.join(attempts)})")
            await _until(reached(target - 1), 600, f"version {target - 1}")
            paused = [publisher]
            publisher.process.send(signal.SIGSTOP)
            try:
                if newest() >= target:
                    attempts.append(f"v{target} was published before the publisher was paused")
                    continue
                try:
                    await _until(staged(target), 120, f"v{target} staged")
                except FaultFailed as exc:
                    attempts.append(str(exc))
                    continue
                for proc in (learner, *workers):
                    proc.process.send(signal.SIGSTOP)
                    paused.append(proc)
                publisher.process.send(signal.SIGCONT)
                paused.remove(publisher)
                try:
                    await _until(stored(target), 30, f"v{target} stored")
                except FaultFailed as exc:
                    attempts.append(str(exc))
                    continue
                manifest = read_manifest(store, manifest_key(run_id, target))
                path = root / shard_key(run_id, target, 0)
                data = bytearray(path.read_bytes())
                mid = len(data) // 2
                for i in range(mid, min(mid + 16, len(data))):
                    data[i] ^= 0xFF
                path.write_bytes(bytes(data))
                self.corrupted[target] = time.time()
                for w in workers:
                    w.process.send(signal.SIGCONT)
                    paused.remove(w)
                took = await _until(refused(target), 60, f"a worker refusing v{target}")
                break
            finally:
                for proc in reversed(paused):
                    proc.process.send(signal.SIGCONT)
        moved = await _until(passed(target), 300, f"a version after {target}")
        rec.detail = {
            "version": target,
            "shard": shard_key(run_id, target, 0),
            "shards_in_version": len(manifest.shards),
            "refused_after_s": round(took, 2),
            "next_version_applied_after_s": round(took + moved, 2),
            "skipped_attempts": attempts,
        }
        return (
            f"flipped 16 bytes of {rec.detail['shard']}; the workers refused v{target} on its sha256 "
            f"{took:.1f} s later and applied a later version {moved:.1f} s after that"
        )

    async def _permission(self, rec: FaultRecord) -> str:
        """Publishes outside a user's permissions: the server must refuse them and no stream may grow."""
        import nats

        from slipstream.schemas import SCHEMA_HEADER, WeightAnnounce, encode, schema_header

        stack = self.stack
        if stack.credentials is None:
            raise FaultFailed("this stack runs without per-service users (secure = false)")
        url = stack.servers["nats"].url
        env = self.plan.env
        announce = WeightAnnounce(policy_version=IMPOSTOR_VERSION, manifest_key="x", run_id=stack.spec.run_id)
        attempts = [
            # (user, subject, stream): only the rollout workers publish raw episodes, only the
            # reward-model scored ones, only the weight-publisher announces.
            ("reward-model", f"traj.raw.{env}"),
            ("rollout-worker", f"traj.scored.{env}"),
            ("rollout-worker", "weights.announce"),
            ("task-source", "weights.announce"),
        ]
        results: list[dict[str, Any]] = []
        for user, subject in attempts:
            errors: list[str] = []

            async def on_error(exc: Exception, errors: list[str] = errors) -> None:
                errors.append(str(exc))

            password = stack.credentials.nats[user]
            nc = await nats.connect(url, user=user, password=password, error_cb=on_error, name="chaos-impostor")
            try:
                body, headers = encode(announce), {SCHEMA_HEADER: schema_header(WeightAnnounce)}
                await nc.publish(subject, body, headers=headers)
                await nc.flush(timeout=2)
                await asyncio.sleep(0.3)  # the server's -ERR arrives after the flush's pong
            finally:
                await nc.close()
            refused = any("permission" in e.lower() for e in errors)
            results.append({"user": user, "subject": subject, "refused": refused, "error": errors[:1]})
        outsider: str
        # nats-py leaves the socket of a refused first connect open when reconnects are off (it
        # raises before closing), so the client is made first and closed whatever connect did.
        nc = nats.NATS()
        try:
            await nc.connect(url, name="chaos-outsider", allow_reconnect=False, connect_timeout=2)
        except Exception as exc:
            outsider = f"refused: {exc!r}"[:200]
        else:
            outsider = "connected"
        finally:
            await nc.close()
        rec.detail = {"attempts": results, "outsider_without_credentials": outsider}
        failed = [r for r in results if not r["refused"]]
        if failed or outsider == "connected":
            raise FaultFailed(f"not refused: {failed or 'an outsider without credentials connected'}")
        # The audit checks that no announce of IMPOSTOR_VERSION reached the WEIGHTS log.
        return (
            f"{len(results)} publishes outside their users' permissions refused by the server; outsider {outsider[:60]}"
        )

    async def _stop_tool_service(self, rec: FaultRecord) -> str:
        """Stop one replica for good; the others must go on answering the workers' calls."""
        services = self.stack.services
        names = [n for n in services if n.startswith("tool-service")]
        victim, left = names[-1], names[:-1]
        before = {n: await asyncio.to_thread(handled_calls, services[n].port) for n in names}
        if not sum(before.values()):
            raise FaultFailed(f"no replica has answered a call yet ({before}): the workers do not call them")
        code = await asyncio.to_thread(self.stack.stop_service, victim, 5.0)
        took = await self._next_steps(self.gap, 300)
        after = {n: await asyncio.to_thread(handled_calls, services[n].port) for n in left}
        rec.detail = {"stopped": victim, "exit_code": code, "left": left}
        rec.detail.update({"calls_answered_before": before, "calls_answered_after": after})
        if not any(after[n] > before[n] for n in left):
            raise FaultFailed(f"the replicas left answered no call after the stop: {before} -> {after}")
        return (
            f"stopped {victim} (exit {code}) after it answered {before[victim]} calls; {len(left)} left, "
            f"which answered {sum(after[n] - before[n] for n in left)} more while training moved {self.gap} "
            f"steps in {took:.1f} s"
        )


def handled_calls(port: int) -> int:
    """Calls a tool-service replica answered (`handled` in its /readyz status)."""
    from slipstream.stack.status import read_json

    _, body = read_json(port, "/readyz", 2.0)
    handled = ((body or {}).get("status") or {}).get("handled")
    if not isinstance(handled, int):
        raise FaultFailed(f"the tool-service on port {port} reports no handled calls in /readyz: {body}")
    return handled


# -- reading NATS --------------------------------------------------------------------------------------


async def _dlq_counts(stack: Any) -> dict[str, int]:
    import nats

    nc = await nats.connect(stack.servers["nats"].url, name="chaos-audit", **stack.admin_nats_options())
    try:
        info = await nc.jetstream().stream_info("DLQ", subjects_filter="dlq.>")
        return {k.removeprefix("dlq."): int(v) for k, v in (info.state.subjects or {}).items()}
    finally:
        await nc.close()


async def _stream_seqs(stack: Any) -> dict[str, int]:
    import nats

    nc = await nats.connect(stack.servers["nats"].url, name="chaos-audit", **stack.admin_nats_options())
    try:
        js = nc.jetstream()
        out = {}
        for name in ("TASKS", "TRAJ_RAW", "TRAJ_SCORED", "WEIGHTS", "DLQ"):
            out[name] = int((await js.stream_info(name)).state.last_seq)
        return out
    finally:
        await nc.close()


async def _publish_announces(stack: Any, announces: dict[str, Any]) -> None:
    """As the admin: with per-service users nobody else may publish there (the permission fault shows it)."""
    from slipstream.bus import connect_bus
    from slipstream.schemas.subjects import WEIGHTS_ANNOUNCE

    bus = await connect_bus(stack.admin_bus(type="nats"), name="chaos-forger")
    try:
        for reason, announce in announces.items():
            await bus.publish(WEIGHTS_ANNOUNCE, announce, msg_id=f"chaos-forged:{reason}:{time.time()}")
    finally:
        await bus.close()
