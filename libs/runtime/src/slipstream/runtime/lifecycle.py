"""The one way a service process starts, runs and stops.

    starting -> ready -> running -> draining -> stopped
        \\________________\\____________\\______-> failed

`serve` drives a `Service` through that machine: probes listen from the first moment (liveness
must not depend on NATS or S3), `setup` runs, `run(stop)` runs until SIGTERM/SIGINT sets `stop`
(the signal does nothing else), then the service gets `drain_timeout_s` to return from `run` and
`drain`. When the budget runs out, or a second signal arrives, what is still in flight is logged
and the service is closed anyway. Exit codes: 0 clean, 1 failed (the cause is logged with its
traceback and readiness never comes back), 3 closed with work still in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import structlog

from slipstream.runtime.probes import ProbeServer
from slipstream.runtime.section import ServiceSection
from slipstream.runtime.service import Service
from slipstream.telemetry.config import TelemetryConfig
from slipstream.telemetry.metrics import REGISTRY

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_DRAIN_TIMEOUT = 3
# close() releases connections; it gets its own bound so a hung client cannot keep a pod alive.
CLOSE_TIMEOUT_S = 10.0

log = structlog.get_logger("slipstream.runtime")


class State(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


def replica_id(cfg: ServiceSection) -> str:
    """The configured replica id, else `<hostname>-<pid>` (unique per process on a host)."""
    return cfg.replica or f"{socket.gethostname()}-{os.getpid()}"


class Runtime:
    """One service process: its state, probes, signal handling and shutdown budget."""

    def __init__(self, service: Service, cfg: ServiceSection, *, replica: str = "") -> None:
        self.service = service
        self.cfg = cfg
        self.replica = replica or replica_id(cfg)
        self.state = State.STARTING
        self.stop = asyncio.Event()
        self.force = asyncio.Event()
        self.started = time.monotonic()
        self.port = 0
        self._state_gauge = REGISTRY.gauge(f"{service.name}/runtime/state", "1 for the current lifecycle state.")
        self._uptime = REGISTRY.gauge(f"{service.name}/runtime/uptime_s", "Seconds since the process started.")
        self._ready_errors = REGISTRY.counter(
            f"{service.name}/runtime/readiness_errors", "Readiness checks that raised (reported as not ready)."
        )
        self._set_gauges()

    # --- state ----------------------------------------------------------------------------------

    def _set_gauges(self) -> None:
        for s in State:
            self._state_gauge.set(1.0 if s is self.state else 0.0, state=s.value)
        self._uptime.set(time.monotonic() - self.started)

    def _enter(self, new: State, **fields: Any) -> None:
        previous, self.state = self.state, new
        self._set_gauges()
        level = log.error if new is State.FAILED else log.info
        level("state", state=new.value, previous=previous.value, **fields)

    def request_stop(self, reason: str) -> None:
        """What SIGTERM/SIGINT do: the first sets `stop`, a second forces the close."""
        if not self.stop.is_set():
            log.info("stop requested", reason=reason, state=self.state.value)
            self.stop.set()
        elif not self.force.is_set():
            log.warning("second stop request: closing without waiting for in-flight work", reason=reason)
            self.force.set()

    # --- probes ---------------------------------------------------------------------------------

    def healthy(self) -> bool:
        return self.state is not State.FAILED

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        try:
            service_ready = bool(self.service.ready())
            status = self.service.status()
        except Exception as exc:
            # A probe must answer; a broken check is "not ready", counted and logged.
            self._ready_errors.add()
            log.warning("readiness check raised", error=repr(exc))
            service_ready, status = False, {"error": repr(exc)}
        ready = self.state is State.RUNNING and service_ready
        body = {
            "service": self.service.name,
            "replica": self.replica,
            "state": self.state.value,
            "ready": ready,
            "status": status,
        }
        return ready, body

    def metrics(self) -> str:
        self._uptime.set(time.monotonic() - self.started)
        return REGISTRY.render_prometheus()

    def _write_port_file(self) -> None:
        if not self.cfg.port_file:
            return
        path = Path(self.cfg.port_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(f"{self.port}\n")
        # Atomic rename: a supervisor polling the file never reads half a number.
        os.replace(tmp, path)

    def _remove_port_file(self) -> None:
        if not self.cfg.port_file:
            return
        path = Path(self.cfg.port_file)
        with contextlib.suppress(OSError):
            if path.read_text().strip() == str(self.port):
                path.unlink()

    # --- the machine ----------------------------------------------------------------------------

    async def run(self, *, handle_signals: bool = True) -> int:
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT) if handle_signals else ()
        for sig in signals:
            loop.add_signal_handler(sig, self.request_stop, signal.Signals(sig).name)
        probes = ProbeServer(
            self.service.name,
            self.cfg.http_host,
            self.cfg.http_port,
            healthy=self.healthy,
            readiness=self.readiness,
            metrics=self.metrics,
        )
        try:
            self.port = await probes.start()
            log.info("http listening", host=self.cfg.http_host, port=self.port, replica=self.replica)
            self._write_port_file()
            log.info("state", state=self.state.value)
            code = await self._lifecycle()
            log.info("exit", code=code, state=self.state.value, uptime_s=round(time.monotonic() - self.started, 3))
            return code
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
            await probes.close()
            self._remove_port_file()

    async def _lifecycle(self) -> int:
        svc = self.service
        setup = asyncio.create_task(svc.setup(), name=f"{svc.name}.setup")
        try:
            finished = await self._race(setup, self.stop)
        except Exception as exc:
            log.error("setup failed", error=repr(exc), exc_info=True)
            self._enter(State.FAILED, during="setup")
            await self._close(EXIT_FAILED)
            return EXIT_FAILED
        if not finished:
            # Stopped before it was ever ready: nothing was taken, so nothing to drain.
            await self._cancel([setup])
            await self._close(EXIT_OK)
            self._enter(State.STOPPED, during="setup")
            return EXIT_OK
        self._enter(State.READY)
        work = asyncio.create_task(svc.run(self.stop), name=f"{svc.name}.run")
        self._enter(State.RUNNING)
        code = EXIT_OK
        try:
            await self._race(work, self.stop)
        except Exception as exc:
            log.error("run failed", error=repr(exc), exc_info=True)
            self._enter(State.FAILED, during="run")
            code = EXIT_FAILED
        if code == EXIT_OK:
            self._enter(State.DRAINING, reason="stop requested" if self.stop.is_set() else "run returned")
        code = await self._drain(work, code)
        code = await self._close(code)
        if self.state is not State.FAILED:
            self._enter(State.STOPPED, exit_code=code)
        return code

    async def _drain(self, work: asyncio.Task[None], code: int) -> int:
        """Let `run` return and `drain` finish within the budget; past it, log what is in flight."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.drain_timeout_s
        pending: list[asyncio.Task[None]] = [work]
        if await self._within(work, deadline):
            exc = None if work.cancelled() else work.exception()
            if exc is not None and code == EXIT_OK:
                # run raised after stop was set: still a failure, and what is left still gets drained.
                log.error("run failed while stopping", error=repr(exc), exc_info=exc)
                self._enter(State.FAILED, during="drain")
                code = EXIT_FAILED
            drain = asyncio.create_task(self.service.drain(), name=f"{self.service.name}.drain")
            pending.append(drain)
            if await self._within(drain, deadline):
                exc = None if drain.cancelled() else drain.exception()
                if exc is not None:
                    log.error("drain failed", error=repr(exc), exc_info=exc)
                    self._enter(State.FAILED, during="drain")
                    code = EXIT_FAILED
                return code
        in_flight = self._in_flight()
        log.error(
            "drain incomplete: closing with work in flight",
            in_flight=in_flight,
            forced=self.force.is_set(),
            drain_timeout_s=self.cfg.drain_timeout_s,
            status=self._status(),
        )
        await self._cancel(pending)
        return code if code != EXIT_OK else EXIT_DRAIN_TIMEOUT

    async def _close(self, code: int) -> int:
        try:
            await asyncio.wait_for(self.service.close(), CLOSE_TIMEOUT_S)
        except TimeoutError:
            log.error("close did not finish", close_timeout_s=CLOSE_TIMEOUT_S)
            return code if code != EXIT_OK else EXIT_DRAIN_TIMEOUT
        except Exception:
            log.error("close failed", exc_info=True)
            return code if code != EXIT_OK else EXIT_FAILED
        return code

    # --- helpers --------------------------------------------------------------------------------

    async def _race(self, task: asyncio.Task[None], event: asyncio.Event) -> bool:
        """Wait for `task` or `event`: True if the task finished first (its exception is raised)."""
        waiter = asyncio.create_task(event.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if not task.done():
            return False
        if task.cancelled():
            raise RuntimeError(f"task {task.get_name()} was cancelled from outside the runtime")
        task.result()
        return True

    async def _within(self, task: asyncio.Task[None], deadline: float) -> bool:
        """Wait for `task` until `deadline` or a forced stop; True if it finished."""
        loop = asyncio.get_running_loop()
        forced = asyncio.create_task(self.force.wait())
        try:
            await asyncio.wait(
                {task, forced}, timeout=max(0.0, deadline - loop.time()), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            forced.cancel()
        return task.done()

    async def _cancel(self, tasks: list[asyncio.Task[None]]) -> None:
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass
            except Exception:
                log.error("task failed while being cancelled", task=t.get_name(), exc_info=True)

    def _in_flight(self) -> int | str:
        try:
            return int(self.service.in_flight())
        except Exception as exc:
            return f"unknown ({exc!r})"

    def _status(self) -> Any:
        try:
            return self.service.status()
        except Exception as exc:
            return {"error": repr(exc)}


async def serve(service: Service, cfg: ServiceSection, *, replica: str = "", handle_signals: bool = True) -> int:
    """Run `service` through its whole lifecycle in the current event loop; returns the exit code."""
    return await Runtime(service, cfg, replica=replica).run(handle_signals=handle_signals)


def run_service(service: Service, cfg: ServiceSection, telemetry: TelemetryConfig) -> int:
    """Set up logs, traces and metrics export for `service`, run it in a new event loop, flush them."""
    from slipstream.telemetry.logs import setup_logging
    from slipstream.telemetry.metrics_export import setup_metrics, shutdown_metrics
    from slipstream.telemetry.tracing import setup_tracing, shutdown_tracing

    replica = replica_id(cfg)
    setup_logging(service.name, telemetry, replica=replica, run_id=cfg.run_id)
    setup_tracing(service.name, telemetry, replica=replica)
    setup_metrics(service.name, telemetry, replica=replica)  # OTLP push when configured; /metrics always
    try:
        return asyncio.run(serve(service, cfg, replica=replica))
    finally:
        shutdown_metrics()
        shutdown_tracing()
