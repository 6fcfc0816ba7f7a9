"""`ServeEndpoint`: the endpoint as one object a service starts and stops (aiohttp runner + sweeper).

A rollout worker in serving mode builds one over its engine (`slipstream.rollout_worker` wires
it when `[endpoint] enabled`); tests and `slipstream bench serve` build one over a TorchEngine of
their own. `close()` stops accepting calls, then flushes every open session to the sink, so
nothing recorded is lost on a clean shutdown.

Flushed episodes enter the pending stage (`pending`: a `RedisPending` shared by the replicas, or
in memory) and, when the endpoint has an object store and a bus, its releaser publishes them with
their feedback to `traj.raw.<env>` (`slipstream.serve.release`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from aiohttp import web

from slipstream.engine.interface import Engine
from slipstream.engine.tokenizer import Tokenizer
from slipstream.serve.app import ServeApp
from slipstream.serve.chat import ChatFormat
from slipstream.serve.config import ServeConfig
from slipstream.serve.pending import MemoryPending, PendingPolicy, PendingStore
from slipstream.serve.record import EpisodeSink, Recorder
from slipstream.serve.release import Publisher, Releaser
from slipstream.store import ObjectStore
from slipstream.telemetry.logs import get_logger

log = get_logger(__name__)


def pending_policy(cfg: ServeConfig, run_id: str) -> PendingPolicy:
    """The pending stage's settings from `[endpoint]`."""
    return PendingPolicy(
        env=cfg.env,
        run_id=run_id,
        release_keys=tuple(cfg.release_keys),
        reward_keys=tuple(cfg.reward_keys),
        publish_unrated=cfg.publish_unrated,
        group_size=cfg.group_size,
        group_wait_s=cfg.group_wait_s,
        group_timeout_s=cfg.group_timeout_s,
        retention_s=cfg.feedback_retention_s,
    )


class ServeEndpoint:
    """The OpenAI-compatible endpoint over one engine, recording into `sink`."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        cfg: ServeConfig,
        sink: EpisodeSink,
        *,
        model_name: str,
        run_id: str = "",
        worker_id: str = "",
        middlewares: list[Any] | None = None,
        pending: PendingStore | None = None,
        store: ObjectStore | None = None,
        bus: Publisher | None = None,
        newest_version: Callable[[], int] | None = None,
        release_every_s: float = 1.0,
    ) -> None:
        self.cfg = cfg
        self.fmt = ChatFormat(cfg.renderer, tokenizer)
        self.pending = pending or MemoryPending(pending_policy(cfg, run_id))
        # Episodes are published only where they can be: a store holding their bodies and a bus.
        self.releaser = Releaser(self.pending, store, bus) if store is not None and bus is not None else None
        self.release_every_s = release_every_s
        self.recorder = Recorder(
            sink,
            env=cfg.env,
            run_id=run_id,
            worker_id=worker_id,
            session_idle_s=cfg.session_idle_s,
            replay_window=cfg.replay_window,
            pending=self.pending,
            feedback_deadline_s=cfg.feedback_deadline_s,
        )
        self.app = ServeApp(
            engine, self.fmt, self.recorder, cfg, cfg.model_name or model_name, newest_version=newest_version
        )
        self._middlewares = middlewares
        self._runner: web.AppRunner | None = None
        self._sweep: asyncio.Task[None] | None = None
        self._release: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self.port = 0

    @property
    def model_name(self) -> str:
        return self.app.model_name

    @property
    def base_url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}/v1"

    async def start(self) -> int:
        """Bind and serve; returns the bound port (a free one when `port` is 0)."""
        self._runner = web.AppRunner(self.app.build(self._middlewares), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port, backlog=1024)
        await site.start()
        server = site._server  # aiohttp exposes no public accessor for the bound port
        assert isinstance(server, asyncio.base_events.Server)
        self.port = int(server.sockets[0].getsockname()[1])
        self._sweep = asyncio.create_task(self.recorder.sweep(self._stop), name="serve.sweep")
        if self.releaser is not None:
            self._release = asyncio.create_task(
                self.releaser.run(self._stop, self.release_every_s), name="serve.release"
            )
        return self.port

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._stop.set()
        if self._sweep is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweep  # flushes every open session on its way out
            self._sweep = None
        if self._release is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._release
            self._release = None
            assert self.releaser is not None
            try:
                await self.releaser.step()  # what the last flush made ready goes out now
            except Exception as exc:  # the state stays in the pending store: the next releaser publishes it
                log.warning("serve: last release pass failed", error=repr(exc))
        await self.pending.close()

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"url": self.base_url if self.port else "", "model": self.model_name}
        out.update(self.recorder.stats())
        out["admission_refused"] = self.app.admission_refused
        if self.releaser is not None:
            out.update(
                episodes_released=self.releaser.released,
                episodes_masked=self.releaser.masked,
                release_failures=self.releaser.failures,
            )
        return out
