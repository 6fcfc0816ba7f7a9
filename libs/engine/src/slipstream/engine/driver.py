"""The async face of a step-driven engine: one worker thread runs `step()` while the event loop
that talks to NATS stays responsive.

`StepDriver` knows nothing about models. It is given the engine's synchronous core (`submit`,
`abort`, `step`, `has_work` and a way to abort everything) and turns it into awaitable
generation: `generate` submits a request and awaits its result, the loop wakes whenever work is
queued (from any thread) and runs `step` in the executor until nothing is left, and a fatal
error in `step` fails every waiter and every later caller instead of hanging them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from slipstream.engine.interface import GenerationRequest, GenerationResult

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine loop died; in-flight requests fail with this, carrying the cause."""


class StepDriver:
    """Runs a synchronous engine core's `step` on one worker thread for asyncio callers."""

    def __init__(
        self,
        name: str,
        *,
        submit: Callable[[GenerationRequest], None],
        abort: Callable[[str], bool],
        abort_all: Callable[[], None],
        step: Callable[[], list[GenerationResult]],
        has_work: Callable[[], bool],
    ) -> None:
        self.name = name
        self._submit = submit
        self._abort = abort
        self._abort_all = abort_all
        self._step = step
        self._has_work = has_work
        self._futures: dict[str, asyncio.Future[GenerationResult]] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.closing = False
        self.error: BaseException | None = None

    async def start(self) -> None:
        if self._task is not None:
            return
        if self.closing:
            raise RuntimeError(f"{self.name} was stopped; build a new one")
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slipstream-engine")
        self._task = asyncio.create_task(self._run(), name="slipstream-engine-loop")

    async def stop(self) -> None:
        """Abort everything in flight, let the loop deliver those results, then shut down."""
        self.closing = True
        self._abort_all()
        self.notify()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if self._task is None or self.closing:
            raise RuntimeError(f"{self.name} is not running: await engine.start() first (and not after stop())")
        if self.error is not None:
            raise EngineError("engine loop failed") from self.error
        fut: asyncio.Future[GenerationResult] = asyncio.get_running_loop().create_future()
        if request.request_id in self._futures:
            raise ValueError(f"request {request.request_id!r} is already in flight")
        self._futures[request.request_id] = fut
        try:
            self._submit(request)
            return await fut
        except asyncio.CancelledError:
            self._abort(request.request_id)
            raise
        finally:
            self._futures.pop(request.request_id, None)

    def notify(self) -> None:
        """Wake the loop: queued work may come from another thread (a weight downloader, say), and
        asyncio.Event is not thread-safe, so hop onto the driver's loop then."""
        if self._wake is None or self._loop is None:
            return
        try:
            current = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        if current is self._loop:
            self._wake.set()
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _run(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self._has_work():
                    if self.closing:
                        return
                    self._wake.clear()
                    if not self._has_work():
                        await self._wake.wait()
                    continue
                results = await loop.run_in_executor(self._executor, self._step)
                for res in results:
                    fut = self._futures.get(res.request_id)
                    if fut is not None and not fut.done():
                        fut.set_result(res)
        except Exception as exc:
            # Fatal: report it to every waiter (and to later callers) instead of hanging them.
            self.error = exc
            log.exception("engine loop failed; failing %d in-flight requests", len(self._futures))
            for fut in self._futures.values():
                if not fut.done():
                    fut.set_exception(EngineError(f"engine loop failed: {exc!r}"))
            raise
