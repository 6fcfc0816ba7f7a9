"""`ServeEndpoint`: the endpoint as one object a service starts and stops (aiohttp runner + sweeper).

A rollout worker in serving mode builds one over its engine (`slipstream.rollout_worker` wires
it when `[endpoint] enabled`); tests and `slipstream bench serve` build one over a TorchEngine of
their own. `close()` stops accepting calls, then flushes every open session to the sink, so
nothing recorded is lost on a clean shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from aiohttp import web

from slipstream.engine.interface import Engine
from slipstream.engine.tokenizer import Tokenizer
from slipstream.serve.app import ServeApp
from slipstream.serve.chat import ChatFormat
from slipstream.serve.config import ServeConfig
from slipstream.serve.record import EpisodeSink, Recorder


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
    ) -> None:
        self.cfg = cfg
        self.fmt = ChatFormat(cfg.renderer, tokenizer)
        self.recorder = Recorder(
            sink,
            env=cfg.env,
            run_id=run_id,
            worker_id=worker_id,
            session_idle_s=cfg.session_idle_s,
            replay_window=cfg.replay_window,
        )
        self.app = ServeApp(engine, self.fmt, self.recorder, cfg, cfg.model_name or model_name)
        self._middlewares = middlewares
        self._runner: web.AppRunner | None = None
        self._sweep: asyncio.Task[None] | None = None
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

    def status(self) -> dict[str, Any]:
        return {"url": self.base_url if self.port else "", "model": self.model_name, **self.recorder.stats()}
