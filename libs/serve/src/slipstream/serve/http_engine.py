"""`HttpEngine`: the Engine protocol over a dedicated inference server's token-id HTTP API.

A rollout worker with `[engine] type = "http"` drives a server (`python -m
slipstream.serve.inference`) exactly as it drives an in-process TorchEngine: token ids in,
token ids, behaviour log-probs and per-token policy versions out (inference_wire.py).

How the synchronous parts of the protocol map onto a socket:
- `apply_weights` checks names, shapes and dtypes against the parameter list the server gave
  at `start()` (the same checks and messages as TorchEngine, before anything is sent), then
  queues the upload; one uploader sends versions in order as safetensors bodies. The server
  answers once the version is copied in between two decode steps, and only then does
  `policy_version` move, so a caller waiting for it (the weight follower) knows tokens sampled
  from then on use it. An upload the server refuses or that fails is logged and counted
  (`stats()["weight_update_failures"]`); the version then never appears.
- `policy_version` and `stats()` are the server's, as of its latest answer (every answer
  carries them; the one with the most updates applied, then engine steps, wins, so a slow answer
  never moves them back).
- `release` is sent in the background, and a later `generate` waits for it first.
- `named_parameters` / `state_dict` download a copy of every parameter (`GET /weights`): they
  block, so they refuse to run on the event loop's thread (call them via `asyncio.to_thread`);
  `param_specs` describes the parameters without downloading them.
- `stop` aborts this client's in-flight requests on the server (they return with finish_reason
  'abort', as on TorchEngine); the server itself keeps running.

Unreachable servers, timeouts and server-side failures raise `HttpEngineError` (an `EngineError`,
which a rollout worker treats as fatal: it hands its tasks back and exits, and its restart
reconnects) naming the URL; a request the server refuses (bad prompt, duplicate id) raises
ValueError. A server that restarted (a new `server_id` in its answers) has lost every applied
version: from then on every call raises, rather than sample with weights the caller does not
know about.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec

from slipstream.engine.backend import EngineBackend
from slipstream.engine.driver import EngineError
from slipstream.engine.interface import GenerationRequest, GenerationResult, ParamSpec
from slipstream.serve import inference_wire as wire

if TYPE_CHECKING:
    from torch import Tensor, nn

log = logging.getLogger(__name__)


class HttpEngineError(EngineError):
    """The inference server is unreachable, timed out, or failed; the message names its URL."""


class HttpEngine:
    """The Engine protocol on a Slipstream inference server at `url`."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout_s: float = 10.0,
        request_timeout_s: float = 600.0,
        weights_timeout_s: float = 300.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.weights_timeout_s = weights_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._specs: dict[str, ParamSpec] = {}
        self._aliases: dict[str, str] = {}
        self._partial = False
        self._server_stats: dict[str, float] = {}
        self._order = (-1.0, -1.0)
        self._server_id = ""
        self._lost: HttpEngineError | None = None
        self._version = 0
        self._uploads: asyncio.Queue[tuple[int, dict[str, Tensor]]] | None = None
        self._uploader: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._releases: list[asyncio.Task[None]] = []
        self._in_flight: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._closing = False
        self._update_failures = 0
        self._updates_sent = 0
        self._generate_failures = 0
        self.last_update_error = ""

    @classmethod
    def from_config(cls, cfg: EngineBackend) -> HttpEngine:
        if cfg.type != "http":
            raise ValueError(f"HttpEngine needs [engine] type = 'http', got {cfg.type!r}")
        return cls(
            cfg.url,
            connect_timeout_s=cfg.connect_timeout_s,
            request_timeout_s=cfg.request_timeout_s,
            weights_timeout_s=cfg.weights_timeout_s,
        )

    # ----------------------------------------------------------------- protocol: state
    @property
    def policy_version(self) -> int:
        """The server's weights version as of its latest answer."""
        return self._version

    def param_specs(self) -> Mapping[str, ParamSpec]:
        """Shape and dtype of every server parameter (from `start()`), without downloading them."""
        return dict(self._specs)

    def stats(self) -> dict[str, float]:
        return {
            **self._server_stats,
            "policy_version": float(self._version),
            "http_in_flight": float(len(self._in_flight)),
            "weight_updates_sent": float(self._updates_sent),
            "weight_update_failures": float(self._update_failures),
            "generate_failures": float(self._generate_failures),
        }

    def _note(self, version: int, stats: Mapping[str, float], server_id: str) -> None:
        """Take the server's version and counters from an answer unless a later answer came first.

        Answers are ordered by (updates applied, engine steps): an update is counted during the
        step that copies it in, before that step is, so an update's answer and a generate answer
        from just before it can carry the same step count, never the same update count.
        """
        if server_id != self._server_id:
            if not self._server_id:
                self._server_id = server_id
            elif self._lost is None:
                self._lost = HttpEngineError(
                    f"inference server {self.url} restarted (server id {self._server_id} -> {server_id}): it serves "
                    f"version {version} again while this engine had version {self._version}; restart the caller "
                    "so that it fetches and applies the current version"
                )
                log.error("%s", self._lost)
            return
        key = (stats.get("weight_updates", 0.0), stats.get("steps", 0.0))
        if key >= self._order:
            self._order = key
            self._server_stats = dict(stats)
            self._version = version

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Connect and read the server's parameter list; raises EngineError naming the URL if unreachable."""
        if self._session is not None:
            return
        if self._closing:
            raise RuntimeError("HttpEngine was stopped; build a new one")
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s, connect=self.connect_timeout_s)
        # No connection cap: every in-flight request holds one, and the server batches them all.
        self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        try:
            info = await self._get(wire.WEIGHT_INFO, wire.WeightInfo, self.connect_timeout_s + 30.0)
        except BaseException:
            await self._session.close()
            self._session = None
            raise
        self._specs = {n: ParamSpec(tuple(p.shape), p.dtype) for n, p in info.parameters.items()}
        self._aliases = dict(info.aliases)
        self._partial = info.partial
        self._note(info.policy_version, info.stats, info.server_id)
        self._uploads = asyncio.Queue()
        self._uploader = asyncio.create_task(self._upload_loop(), name="http-engine-uploads")

    async def stop(self) -> None:
        """Abort this client's in-flight requests (they return with 'abort'), then disconnect."""
        self._closing = True
        if self._session is None:
            return
        ids = sorted(self._in_flight)
        if ids:
            with contextlib.suppress(EngineError):
                await self._post(wire.ABORT, wire.AbortBody(request_ids=ids), self.connect_timeout_s + 10.0)
            # The aborted calls answer as soon as the server's next step retires them.
            for _ in range(int(self.connect_timeout_s * 100) + 1000):
                if not self._in_flight:
                    break
                await asyncio.sleep(0.01)
        tasks = [t for t in (self._uploader, *self._background) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._uploader = None
        await self._session.close()
        self._session = None

    # ----------------------------------------------------------------- generate
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if self._session is None or self._closing:
            raise RuntimeError(
                f"HttpEngine ({self.url}) is not running: await engine.start() first (and not after stop())"
            )
        if self._lost is not None:
            raise self._lost
        if request.request_id in self._in_flight:
            raise ValueError(f"request {request.request_id!r} is already in flight")
        if self._releases:  # a session released before this call must be gone when it arrives
            pending, self._releases = self._releases, []
            await asyncio.gather(*pending, return_exceptions=True)
        body = wire.GenerateBody(
            request_id=request.request_id,
            token_ids=request.prompt_ids,
            sampling_params=request.params,
            session_id=request.session_id,
        )
        self._in_flight.add(request.request_id)
        try:
            answer = await self._post(wire.GENERATE, body, self.request_timeout_s, wire.GenerateAnswer)
        except asyncio.CancelledError:
            self._spawn(self._abort_quietly(request.request_id))
            raise
        except EngineError:
            self._generate_failures += 1
            self._spawn(self._abort_quietly(request.request_id))
            raise
        finally:
            self._in_flight.discard(request.request_id)
        self._note(answer.policy_version, answer.stats, answer.server_id)
        if self._lost is not None:
            raise self._lost
        choice = answer.choices[0]
        return GenerationResult(
            request_id=answer.request_id,
            prompt_ids=answer.prompt_token_ids,
            completion_ids=choice.token_ids,
            logprobs=choice.logprobs,
            segments=[(int(v), int(n)) for v, n in choice.segments],
            finish_reason=choice.finish_reason,
            timings=answer.timings,
        )

    async def _abort_quietly(self, request_id: str) -> None:
        try:
            await self._post(wire.ABORT, wire.AbortBody(request_ids=[request_id]), self.connect_timeout_s + 10.0)
        except EngineError as exc:
            log.warning("could not abort request %s on %s: %s", request_id, self.url, exc)

    def release(self, session_id: str) -> None:
        """Drop a session's kept KV cache on the server (sent in the background; ordered before later calls)."""
        if not session_id or self._session is None:
            return
        self._releases.append(self._spawn(self._release(session_id)))

    async def _release(self, session_id: str) -> None:
        try:
            await self._post(wire.RELEASE, wire.ReleaseBody(session_id=session_id), self.connect_timeout_s + 10.0)
        except EngineError as exc:
            log.warning("could not release session %s on %s: %s", session_id, self.url, exc)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro, loop=self._loop)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # ----------------------------------------------------------------- weights
    def apply_weights(self, version: int, tensors: Mapping[str, Tensor], *, partial: bool | None = None) -> None:
        """Check the update against the server's parameters (ValueError naming the tensor; nothing
        sent then), then queue its upload. The caller must not modify `tensors` meanwhile."""
        from slipstream.engine.weight_update import validate_against

        if self._uploads is None or self._loop is None:
            raise RuntimeError(f"HttpEngine ({self.url}) is not running: await engine.start() first")
        partial = self._partial if partial is None else partial
        update = validate_against(self._specs, self._aliases, version, tensors, partial=partial)
        item = (update.version, update.tensors)
        if threading.get_ident() == self._loop_thread:
            self._uploads.put_nowait(item)
        else:
            self._loop.call_soon_threadsafe(self._uploads.put_nowait, item)

    async def _upload_loop(self) -> None:
        assert self._uploads is not None
        while True:
            version, tensors = await self._uploads.get()
            try:
                await self._upload(version, tensors)
            except Exception as exc:  # reported, not swallowed: counted, logged, kept for status
                self._update_failures += 1
                self.last_update_error = repr(exc)
                log.error("weight version %d not applied on %s: %s", version, self.url, exc)

    async def _upload(self, version: int, tensors: dict[str, Tensor]) -> None:
        from safetensors.torch import save as st_save

        data = await asyncio.to_thread(
            lambda: st_save({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()})
        )
        self._updates_sent += 1
        answer = await self._request(
            "POST",
            f"{wire.UPDATE_WEIGHTS}?version={version}",
            self.weights_timeout_s,
            wire.UpdateAnswer,
            data=io.BytesIO(data),  # streamed: a raw bytes body this large would block the loop
            headers={"content-type": "application/octet-stream"},
        )
        self._note(answer.policy_version, answer.stats, answer.server_id)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """A downloaded copy of every parameter (not live: updating it changes nothing on the server)."""
        from torch import nn

        for name, value in self._download().items():
            yield name, nn.Parameter(value, requires_grad=False)

    def state_dict(self) -> Mapping[str, Any]:
        """A downloaded copy of every parameter, tied aliases included (as TorchEngine's model has them)."""
        params = self._download()
        for alias, target in self._aliases.items():
            if target in params:
                params[alias] = params[target]
        return params

    def _download(self) -> dict[str, Tensor]:
        from safetensors.torch import load as st_load

        if threading.get_ident() == self._loop_thread:
            raise RuntimeError(
                f"HttpEngine ({self.url}).state_dict()/named_parameters() download every weight and block; "
                "call them off the event loop (asyncio.to_thread), or use param_specs() for names and shapes"
            )
        try:
            with urllib.request.urlopen(self.url + wire.WEIGHTS, timeout=self.weights_timeout_s) as resp:
                data = resp.read()
        except urllib.error.HTTPError as exc:
            raise HttpEngineError(f"{self.url}{wire.WEIGHTS} answered {exc.code}: {exc.read()[:300]!r}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise HttpEngineError(f"inference server {self.url} is unreachable: {exc}") from None
        return dict(st_load(data))

    # ----------------------------------------------------------------- transport
    async def _get(self, path: str, answer: type[Any], timeout_s: float) -> Any:
        return await self._request("GET", path, timeout_s, answer)

    async def _post(self, path: str, body: Any, timeout_s: float, answer: type[Any] | None = None) -> Any:
        return await self._request(
            "POST",
            path,
            timeout_s,
            answer,
            data=msgspec.json.encode(body),
            headers={"content-type": "application/json"},
        )

    async def _request(
        self,
        method: str,
        path: str,
        timeout_s: float,
        answer: type[Any] | None,
        *,
        data: bytes | io.BytesIO | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        if self._session is None:
            raise HttpEngineError(f"HttpEngine ({self.url}) is not connected")
        url = self.url + path
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.connect_timeout_s)
        try:
            async with self._session.request(method, url, data=data, headers=headers, timeout=timeout) as resp:
                raw = await resp.read()
                status = resp.status
        except TimeoutError:
            raise HttpEngineError(f"{method} {url} got no answer within {timeout_s:g}s") from None
        except aiohttp.ClientConnectionError as exc:
            raise HttpEngineError(f"inference server {self.url} is unreachable ({method} {path}): {exc}") from None
        if status >= 400:
            message = _error_message(raw)
            if status in (400, 409):
                raise ValueError(message)
            raise HttpEngineError(f"{method} {url} answered {status}: {message}")
        if answer is None:
            return None
        return msgspec.json.decode(raw, type=answer)


def _error_message(raw: bytes) -> str:
    try:
        return msgspec.json.decode(raw, type=wire.ErrorAnswer).error.message
    except (msgspec.ValidationError, msgspec.DecodeError):
        return raw[:300].decode("utf-8", "replace")
