"""A running stack watched live: what `slipstream top` samples every interval and draws.

`StackWatch` reads the run's `stack.json`, probes each service's /readyz and scrapes its
/metrics, asks the bus for every work stream's backlog and the dead-letter count, and follows
`learner.step`, `weights.announce` and `weights.promoted`; each `sample()` is a `Frame`, which
`render` draws (services, stage backlogs with the slowest highlighted, versions, sparklines);
`show` runs the loop, or one frame with `once`.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream.stack.stackfile import FILE as STACK_FILE
from slipstream.stack.stackfile import ServiceEntry, StackFile, StackFileError, read_stack_file

if TYPE_CHECKING:
    from rich.console import Group

    from slipstream.bus import Bus
    from slipstream.schemas import LearnerStep, WeightAnnounce, WeightsPromoted
    from slipstream.telemetry.exposition import Exposition

HISTORY = 120
"""Learner steps kept for the sparklines."""


# ---- what one sample holds ----


@dataclass
class ServiceSample:
    name: str
    url: str
    pid: int | None
    alive: bool
    status: int | None = None
    readyz: dict[str, Any] = field(default_factory=dict)
    metrics: Exposition | None = None
    error: str = ""
    rate_in: float | None = None
    rate_out: float | None = None

    @property
    def health(self) -> str:
        if not self.alive:
            return "exited"
        if self.status is None:
            return "no answer"
        return "ready" if self.status == 200 else str(self.readyz.get("state", f"not ready ({self.status})"))


@dataclass
class Stage:
    """One work stream and the durable consumer that drains it."""

    stream: str
    durable: str
    service: str
    pending: int | None = None
    in_progress: int | None = None
    rate: float | None = None

    @property
    def drain_s(self) -> float | None:
        """Seconds to drain the backlog at the current rate (inf when stalled with a backlog)."""
        if self.pending is None or self.rate is None:
            return None
        if self.pending == 0:
            return 0.0
        return self.pending / self.rate if self.rate > 0 else math.inf


@dataclass
class Frame:
    run_id: str
    state: str
    at: float
    services: list[ServiceSample]
    stages: list[Stage]
    dead_letters: int | None
    steps: list[LearnerStep]
    announced: WeightAnnounce | None
    promoted: WeightsPromoted | None
    notes: list[str]


class StackStateError(Exception):
    """The run's stack.json is missing or unreadable."""


def slowest(stages: list[Stage]) -> Stage | None:
    """The stage whose backlog takes longest to drain at its consumer's rate; None without a backlog."""
    candidates = [s for s in stages if s.pending and s.drain_s is not None]
    if not candidates:
        return None
    return max(candidates, key=lambda s: (s.drain_s or 0.0, s.pending or 0))


# ---- sampling ----


def _get(url: str, path: str, timeout_s: float) -> tuple[int, bytes]:
    host, _, port = url.removeprefix("http://").partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _probe(name: str, info: ServiceEntry, timeout_s: float) -> ServiceSample:
    from slipstream.stack import pid_alive
    from slipstream.telemetry.exposition import parse_prometheus

    pid = info.pid
    alive = pid is not None and pid_alive(pid)
    sample = ServiceSample(name, info.url, pid, alive=alive)
    if not sample.alive:
        return sample
    try:
        sample.status, body = _get(sample.url, "/readyz", timeout_s)
        sample.readyz = json.loads(body or b"{}")
        status, body = _get(sample.url, "/metrics", timeout_s)
        if status == 200:
            sample.metrics = parse_prometheus(body.decode())
    except (OSError, http.client.HTTPException, ValueError) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
    return sample


def _consumed(exp: Exposition) -> float:
    # Fan-out reads (every replica sees every announce) are not work taken from a stage.
    return sum(s.value for s in exp.select("bus_consume_messages_total") if s.labels.get("durable") != "fanout")


class StackWatch:
    """Samples one stack; keeps the previous counters (for rates) and the bus followers' state."""

    def __init__(self, run_dir: Path, *, timeout_s: float = 1.0) -> None:
        self.run_dir = run_dir
        self.timeout_s = timeout_s
        self.info = self._read_state()
        self.bus: Bus | None = None
        self.steps: deque[LearnerStep] = deque(maxlen=HISTORY)
        self.announced: WeightAnnounce | None = None
        self.promoted: WeightsPromoted | None = None
        self.notes: list[str] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._prev: dict[str, tuple[float, float, float, dict[str, float]]] = {}

    def _read_state(self) -> StackFile:
        path = self.run_dir / STACK_FILE
        if not path.exists():
            raise StackStateError(f"no {path}; start a stack with `slipstream up` (or give --run-dir)")
        try:
            return read_stack_file(self.run_dir)
        except StackFileError as exc:
            raise StackStateError(str(exc)) from None

    async def start(self) -> None:
        from slipstream.bus import BusError, connect_bus
        from slipstream.schemas import LearnerStep, WeightAnnounce, WeightsPromoted
        from slipstream.schemas.subjects import LEARNER_STEP, WEIGHTS_ANNOUNCE, WEIGHTS_PROMOTED
        from slipstream.stack.credentials import bus_config_for

        url = self.info.server_url("nats")
        if not url:
            self.notes.append("stack.json names no NATS server; bus figures unavailable")
            return
        try:
            self.bus = await connect_bus(
                bus_config_for(self.info, connect_budget_s=3.0, connect_timeout_s=1.0), name="slipstream-top"
            )
        except BusError as exc:
            self.notes.append(f"bus at {url} unreachable: {exc}")
            return
        self._follow(LEARNER_STEP, LearnerStep, "all", self._on_step)
        self._follow(WEIGHTS_ANNOUNCE, WeightAnnounce, "last", lambda m: setattr(self, "announced", m))
        self._follow(WEIGHTS_PROMOTED, WeightsPromoted, "last", lambda m: setattr(self, "promoted", m))

    def _on_step(self, step: LearnerStep) -> None:
        self.steps.append(step)

    def _follow(self, subject: str, cls: type[Any], deliver: Any, on: Callable[[Any], None]) -> None:
        assert self.bus is not None
        run_id = self.info.run_id

        async def loop() -> None:
            assert self.bus is not None
            sub = self.bus.subscribe(subject, cls, deliver=deliver)
            try:
                async for d in sub:
                    if not run_id or getattr(d.msg, "run_id", "") in ("", run_id):
                        on(d.msg)
            except Exception as exc:  # a follower that fails leaves the rest of the view working; say why
                self.notes.append(f"following {subject} stopped: {exc!r}")
            finally:
                await sub.close()

        self._tasks.append(asyncio.create_task(loop(), name=f"top.{subject}"))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.bus is not None:
            await self.bus.close()

    async def _stream(self, name: str, problems: list[str]) -> dict[str, Any] | None:
        """A stream's info, or None (a stream not created yet is normal; other failures are noted)."""
        from slipstream.bus import BusError

        assert self.bus is not None
        try:
            return await asyncio.wait_for(self.bus.stream_info(name), self.timeout_s * 2)
        except BusError:
            return None  # the service that owns it has not started yet
        except Exception as exc:  # a slow or disconnected server: show what we have, say what is missing
            problems.append(f"stream {name}: {exc!r}")
            return None

    async def _stages(self, problems: list[str]) -> tuple[list[Stage], int | None]:
        from slipstream.schemas.subjects import STREAMS

        stages = [Stage(s.name, c.durable, c.service) for s in STREAMS for c in s.consumers]
        if self.bus is None:
            return stages, None
        for stage in stages:
            info = await self._stream(stage.stream, problems)
            c = (info or {}).get("consumers", {}).get(stage.durable)
            if c is not None:
                stage.pending, stage.in_progress = int(c["num_pending"]), int(c["num_ack_pending"])
        dlq = await self._stream("DLQ", problems)
        return stages, None if dlq is None else int(dlq["messages"])

    async def sample(self) -> Frame:
        """Probe every service and the bus once; rates are against the previous sample."""
        with contextlib.suppress(StackStateError):
            self.info = self._read_state()  # the state may have moved on (stopped, exit codes)
        now = time.monotonic()
        services = await asyncio.gather(
            *(asyncio.to_thread(_probe, n, i, self.timeout_s) for n, i in self.info.services.items())
        )
        problems: list[str] = []
        stages, dead = await self._stages(problems)
        by_durable: dict[str, float] = {}
        for s in services:
            if s.metrics is None:
                continue
            consumed, published = _consumed(s.metrics), s.metrics.total("bus_publish_messages_total")
            durables = {d.labels.get("durable", ""): d.value for d in s.metrics.select("bus_consume_messages_total")}
            prev = self._prev.get(s.name)
            if prev is not None and now > prev[0]:
                dt = now - prev[0]
                s.rate_in = max(0.0, consumed - prev[1]) / dt
                s.rate_out = max(0.0, published - prev[2]) / dt
                for d, v in durables.items():
                    by_durable[d] = by_durable.get(d, 0.0) + max(0.0, v - prev[3].get(d, 0.0)) / dt
            self._prev[s.name] = (now, consumed, published, durables)
        for stage in stages:
            if stage.service in {s.name for s in services if s.rate_in is not None}:
                stage.rate = by_durable.get(stage.durable, 0.0)
        return Frame(
            run_id=self.info.run_id,
            state=self.info.state,
            at=time.time(),
            services=list(services),
            stages=stages,
            dead_letters=dead,
            steps=list(self.steps),
            announced=self.announced,
            promoted=self.promoted,
            notes=self.notes + problems,
        )


# ---- rendering ----


def _num(v: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def _detail(s: ServiceSample) -> str:
    """The figure that says most about this service, from its own metrics."""
    m = s.metrics
    if m is None:
        return s.error or "-"
    if s.name == "rollout-worker":
        return (
            f"{_num(m.value('worker_engine_tokens_per_s'), '{:.0f}')} tok/s, "
            f"{_num(m.value('worker_tasks_inflight'), '{:.0f}')} tasks in flight"
        )
    if s.name == "reward-model":
        scored = m.total("reward_score_scored_total")
        acc = m.total("reward_score_correct_total") / scored if scored else None
        return f"reward {_num(m.histogram_mean('reward_score_reward'), '{:.3f}')}, correct {_num(acc, '{:.1%}')}"
    if s.name == "learner":
        return (
            f"step time {_num(m.value('learner_step_time_s'), '{:.2f}')} s, "
            f"{_num(m.value('learner_intake_ready_groups'), '{:.0f}')} groups ready"
        )
    if s.name == "weight-publisher":
        return f"publish {_num(m.histogram_mean('publisher_publish_seconds'), '{:.2f}')} s avg"
    if s.name == "task-source":
        return (
            f"{_num(m.value('tasks_source_outstanding'), '{:.0f}')}/"
            f"{_num(m.value('tasks_source_window'), '{:.0f}')} groups outstanding"
        )
    return "-"


def _versions(frame: Frame) -> str:
    last = frame.steps[-1] if frame.steps else None
    parts = [
        f"learner step {last.step} -> v{last.policy_version}" if last else "learner: no step yet",
        f"announced v{frame.announced.policy_version}" if frame.announced else "announced: none",
        f"promoted v{frame.promoted.policy_version}" if frame.promoted else "promoted: none",
    ]
    for s in frame.services:
        applied = s.metrics.value("worker_weights_applied_version") if s.metrics else None
        if applied is not None and not math.isnan(applied):
            parts.append(f"{s.name} applies v{applied:.0f}")
    return "versions: " + " · ".join(parts)


def render(frame: Frame) -> Group:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from slipstream.run.progress import sparkline

    head = Text(f"slipstream top — run {frame.run_id} ({frame.state}) at {time.strftime('%H:%M:%S')}", style="bold")
    services = Table(title="services", title_justify="left", expand=False)
    for col, just in (("service", "left"), ("replica", "left"), ("health", "left")):
        services.add_column(col, justify=just, no_wrap=True)  # type: ignore[arg-type]
    for col in ("in/s", "out/s"):
        services.add_column(col, justify="right", no_wrap=True)
    services.add_column("detail")
    for s in frame.services:
        style = {"ready": "green", "exited": "red", "no answer": "red"}.get(s.health, "yellow")
        services.add_row(
            s.name,
            str(s.readyz.get("replica", s.pid or "-")),
            f"[{style}]{s.health}[/{style}]",
            _num(s.rate_in),
            _num(s.rate_out),
            _detail(s),
        )

    worst = slowest(frame.stages)
    stages = Table(title="stages (backlog per work stream)", title_justify="left", expand=False)
    for col in ("stream", "consumer", "waiting", "in progress", "taken/s", "drain"):
        stages.add_column(col, justify="left" if col in ("stream", "consumer") else "right", no_wrap=True)
    for st in frame.stages:
        drain = st.drain_s
        drain_txt = "-" if drain is None else ("stalled" if math.isinf(drain) else f"{drain:.0f} s")
        mark = " ◀ slowest" if st is worst else ""
        stages.add_row(
            st.stream,
            st.durable,
            _num(st.pending, "{:d}"),
            _num(st.in_progress, "{:d}"),
            _num(st.rate),
            drain_txt + mark,
            style="bold red" if st is worst else None,
        )

    rewards = [s.reward_mean for s in frame.steps]
    accuracy = [s.accuracy for s in frame.steps]
    last = frame.steps[-1] if frame.steps else None
    lines = [
        _versions(frame),
        f"reward    {_num(rewards[-1] if rewards else None, '{:.3f}'):>6}  {sparkline(rewards)}",
        f"accuracy  {_num(accuracy[-1] if accuracy else None, '{:.3f}'):>6}  {sparkline(accuracy)}",
    ]
    if last is not None:
        stale = " ".join(f"{k}:{v}" for k, v in sorted(last.staleness.items(), key=lambda kv: int(kv[0])))
        lines.append(f"staleness (versions behind: episodes) {stale or '-'}; step time {last.step_time_s:.2f} s")
        lines.append(
            f"episodes  {last.turns_per_episode:.2f} turns, {last.tool_calls_per_turn:.2f} tool calls/turn, "
            f"invalid {last.invalid_call_rate:.3f}, {last.samples_per_episode:.2f} samples"
        )
        if last.logprob_mismatch_by_turn:
            by_turn = sorted(last.logprob_mismatch_by_turn.items(), key=lambda kv: int(kv[0]))
            lines.append("mismatch by turn  " + " ".join(f"{k}:{v:+.3f}" for k, v in by_turn[:8]))
    dead = "-" if frame.dead_letters is None else str(frame.dead_letters)
    lines.append(f"dead letters: {dead}")
    lines.extend(f"note: {n}" for n in frame.notes)
    return Group(head, services, stages, Text("\n".join(lines)))


# ---- the loop ----


async def show(run_dir: Path, console: Any, *, once: bool = False, interval: float = 2.0) -> int:
    """Draw the stack in `run_dir` every `interval` seconds until cancelled; `once`: one frame (two samples apart)."""
    watch = StackWatch(run_dir)
    await watch.start()
    try:
        if once:
            await watch.sample()
            await asyncio.sleep(interval)
            console.print(render(await watch.sample()))
            return 0
        from rich.live import Live

        with Live(render(await watch.sample()), console=console, auto_refresh=False, screen=False) as live:
            while True:
                await asyncio.sleep(interval)
                live.update(render(await watch.sample()), refresh=True)
    finally:
        await watch.close()
