"""Between a Slipstream episode and a verifiers harness: a local generate route and the runner process.

A verifiers harness renders its prompts itself and samples through vLLM's
`/inference/v1/generate` (its training client). In a rollout worker the policy is the worker's
own engine, reached through the episode's `EpisodeContext`, so this module serves that route on
loopback inside the worker, once per process, and sends each request to the episode it belongs
to: the runner is told to send `X-Slipstream-Episode: <key>` on every request of an episode
(the harness adds its own per-rollout `X-Session-ID` too; the key is ours so that no guess about
its value is needed).

For one episode, a request whose prompt ids extend the sample it holds (the ids of everything
so far, then new ids: a tool result, the next user turn) appends those new ids with loss mask 0
(`observe_ids`) and samples; any other prompt opens a new sample (`open_ids`). Either way the
engine samples through `ctx.generate`, and the reply carries exactly its ids and log-probs, so
the episode records exactly what the harness was served. The wire shape is libs/serve's
(`slipstream.serve.generate`), the one Slipstream's endpoint serves.

`Runner` keeps the verifiers-side process (`runner.py`, run by verifiers' own interpreter) and
matches its answers to the episodes that asked. Closing it ends everything started beneath it
(reaper.py): its input closes, it cancels its episodes, lets verifiers tear them down and kills
what is left beneath it (it is their subreaper, so tool servers in sessions of their own too);
should it not exit within `CLOSE_S`, its whole tree is frozen and killed from here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from aiohttp import web

from slipstream.envs.context import EpisodeContext, Thread
from slipstream.envs.registry import on_close
from slipstream.envs.verifiers.reaper import kill_tree
from slipstream.serve.generate import ROUTE, choice_body, parse_generate
from slipstream.serve.protocol import RequestError

log = logging.getLogger(__name__)

EPISODE_HEADER = "X-Slipstream-Episode"
RUNNER = Path(__file__).with_name("runner.py")
STARTUP_S = 300.0  # the runner's limit to import verifiers and say it is ready
CLOSE_S = 15.0  # the runner's limit to tear its episodes down and exit once its input closes
ROUTE_SHUTDOWN_S = 2.0  # the route's wait for calls in flight when it closes (aiohttp's default: 60 s)


@dataclass
class Link:
    """One live episode as the route sees it: its context and the sample its harness extends."""

    ctx: EpisodeContext
    thread: Thread | None = None
    calls: int = 0
    samples: int = 0
    texts: list[str] = field(default_factory=list)


class GenerateRoute:
    """`POST /inference/v1/generate` on loopback, each request played in its episode's context."""

    def __init__(self, model: str, max_tokens_limit: int) -> None:
        self.model = model
        self.max_tokens_limit = max_tokens_limit
        self.links: dict[str, Link] = {}
        self.runner: web.AppRunner | None = None
        self.base_url = ""

    async def start(self) -> None:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_post(ROUTE, self.generate)
        app.router.add_get("/v1/models", self.models)
        # Closed after the runner: a call still in flight then has no harness left to answer.
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=ROUTE_SHUTDOWN_S)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.base_url = f"http://127.0.0.1:{port}/v1"

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def generate(self, request: web.Request) -> web.Response:
        key = request.headers.get(EPISODE_HEADER, "")
        link = self.links.get(key)
        if link is None:
            return _error(f"no live episode {key!r} here (header {EPISODE_HEADER})", 404, EPISODE_HEADER)
        try:
            body = json.loads(await request.read())
            _, call = parse_generate(
                {**body, "model": self.model},
                default_max_tokens=self.max_tokens_limit,
                max_tokens_limit=self.max_tokens_limit,
                vocab=None,
            )
        except (ValueError, RequestError) as exc:
            return _error(str(exc), 400, getattr(exc, "param", None))
        ids = list(call.prompt_ids or [])
        ctx, thread = link.ctx, link.thread
        if thread is not None and len(ids) >= len(thread) and ids[: len(thread)] == thread.ids():
            if len(ids) > len(thread):
                ctx.observe_ids(thread, ids[len(thread) :])
        else:
            thread = link.thread = ctx.open_ids(ids)
            link.samples += 1
        generation = await ctx.generate(thread, max_tokens=call.params.max_tokens, stop=list(call.params.stop) or None)
        link.calls += 1
        link.texts.append(generation.text)
        finish = "length" if generation.finish_reason == "length" else "stop"
        return web.json_response(
            {
                "request_id": f"gen-{key}-{link.calls}",
                "prompt_token_ids": ids,
                "choices": [choice_body(0, generation.ids, generation.logprobs, finish)],
            }
        )


def _error(message: str, status: int, param: str | None) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error", "param": param}}, status=status
    )


class Runner:
    """The verifiers-side process (`runner.py` under `python`): asks go in, answers come back by id."""

    def __init__(self, python: str, pythonpath: list[str]) -> None:
        self.python = python
        self.pythonpath = pythonpath
        self.proc: asyncio.subprocess.Process | None = None
        self.waiting: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.reader: asyncio.Task[None] | None = None
        self.lock = asyncio.Lock()

    async def start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(self.pythonpath)
        # The harness's program runs under uv; the runner's interpreter directory holds it.
        env["PATH"] = os.pathsep.join([str(Path(self.python).parent), env.get("PATH", "")])
        self.proc = await asyncio.create_subprocess_exec(
            self.python,
            str(RUNNER),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            limit=64 * 1024 * 1024,
        )
        assert self.proc.stdout is not None
        # Importing verifiers takes ~4 s of a core; on a shared machine with 28 runnable processes
        # on 2 cores it took 110 s of wall time (measured), so the wait is generous.
        first = await asyncio.wait_for(self.proc.stdout.readline(), STARTUP_S)
        if not first or not json.loads(first).get("ready"):
            raise RuntimeError(f"the verifiers runner ({self.python} {RUNNER}) did not start: {first!r}")
        self.reader = asyncio.create_task(self._read(), name="verifiers runner reader")

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            answer = json.loads(line)
            future = self.waiting.pop(str(answer.get("id")), None)
            if future is not None and not future.done():
                future.set_result(answer)
        gone = RuntimeError(f"the verifiers runner exited (code {await self.proc.wait()})")
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(gone)
        self.waiting.clear()

    async def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.proc is None or self.proc.returncode is not None:
            raise RuntimeError("the verifiers runner is not running")
        assert self.proc.stdin is not None
        ident = uuid.uuid4().hex
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiting[ident] = future
        async with self.lock:
            self.proc.stdin.write((json.dumps({**request, "id": ident}) + "\n").encode())
            await self.proc.stdin.drain()
        try:
            return await future
        except asyncio.CancelledError:
            # The asker gave up (an evaluation failed on another episode, a worker stopping): the
            # runner cancels the episode, so verifiers tears down its harness and tool servers now
            # instead of leaving them running until the runner itself closes.
            self.waiting.pop(ident, None)
            if self.proc.returncode is None and not self.proc.stdin.is_closing():
                self.proc.stdin.write((json.dumps({"cancel": ident}) + "\n").encode())
            raise

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), CLOSE_S)
            except TimeoutError:
                # Stopped, the runner still holds what it started (their subreaper): kill all of it.
                killed = await asyncio.to_thread(kill_tree, self.proc.pid, include_root=True)
                log.warning(
                    "verifiers runner %d did not exit in %gs: killed it and %d processes beneath it",
                    self.proc.pid,
                    CLOSE_S,
                    len(killed),
                )
                await self.proc.wait()
        if self.reader is not None:
            await asyncio.gather(self.reader, return_exceptions=True)


class Bridge:
    """The route and the runner one process shares among its episodes (per interpreter and path)."""

    _open: ClassVar[dict[tuple[int, str, tuple[str, ...]], Bridge]] = {}
    _locks: ClassVar[dict[int, asyncio.Lock]] = {}  # one per event loop: a lock binds to the loop that awaits it

    def __init__(self, route: GenerateRoute, runner: Runner, max_concurrent: int = 8) -> None:
        self.route = route
        self.runner = runner
        # Episodes in the runner at once: an eval-gate asking for 64 held-out episodes together
        # started 64 chat programs and 64 MCP servers (~13 GB, load ~70 on 2 cores).
        self.slots = asyncio.Semaphore(max_concurrent)

    @classmethod
    async def get(
        cls, python: str, pythonpath: list[str], model: str, max_tokens_limit: int, max_concurrent: int = 8
    ) -> Bridge:
        """The process's bridge for this interpreter and path; the first caller's `max_concurrent` holds."""
        loop = asyncio.get_running_loop()
        lock = cls._locks.setdefault(id(loop), asyncio.Lock())
        key = (id(loop), python, tuple(pythonpath))
        async with lock:
            bridge = cls._open.get(key)
            if bridge is None or bridge.runner.proc is None or bridge.runner.proc.returncode is not None:
                route = GenerateRoute(model, max_tokens_limit)
                await route.start()
                runner = Runner(python, pythonpath)
                await runner.start()
                bridge = cls._open[key] = Bridge(route, runner, max_concurrent)
                on_close(cls.close_all)  # a worker's shutdown ends the runner and its tree
            return bridge

    @classmethod
    async def close_all(cls) -> None:
        """Stop every bridge this process opened (tests, a worker's shutdown)."""
        bridges, cls._open, cls._locks = list(cls._open.values()), {}, {}
        for bridge in bridges:
            await bridge.runner.close()
            await bridge.route.close()


def interpreter_default() -> str:
    """The interpreter running this process: right when verifiers is installed beside Slipstream."""
    return sys.executable
