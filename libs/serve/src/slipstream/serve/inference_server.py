"""`InferenceServer`: a TorchEngine behind Slipstream's token-id HTTP API (inference_wire.py).

A dedicated inference process that rollout workers drive with `HttpEngine`, as they would a
vLLM or SGLang server: token ids in, token ids + behaviour log-probs + per-token policy versions
out. Many requests share the engine's continuous batch; `POST /update_weights` queues a version
that the engine copies in between two decode steps of whatever is running (TorchEngine's
in-flight refresh), and answers once that copy is done, so a client knows every token sampled
after the answer used the new weights. Errors answer `{"error": {"message", "type"}}` with a
status a client can act on: 400 (bad request or weights, the message names the field or
tensor), 409 (request id already in flight), 503 (the engine loop died), 504 (an update not
applied in time).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from slipstream.engine.driver import EngineError
from slipstream.engine.engine import TorchEngine
from slipstream.engine.interface import GenerationRequest
from slipstream.engine.weight_update import param_specs, tied_aliases
from slipstream.serve import inference_wire as wire
from slipstream.serve.config import InferenceSection
from slipstream.telemetry.logs import get_logger

log = get_logger(__name__)

_APPLY_POLL_S = 0.002
# A snapshot read while an update is being copied in is retried (it could mix two versions).
_SNAPSHOT_TRIES = 5


def _error(status: int, message: str, kind: str) -> web.Response:
    body = msgspec.json.encode(wire.ErrorAnswer(error=wire.ErrorBody(message=message, type=kind)))
    return web.Response(status=status, body=body, content_type="application/json")


def _json(obj: Any) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), content_type="application/json")


class InferenceServer:
    """Serves one TorchEngine on `cfg.host:cfg.port`; `start()` returns the bound port."""

    def __init__(self, engine: TorchEngine, cfg: InferenceSection) -> None:
        self.engine = engine
        self.cfg = cfg
        self.port = 0
        # Every answer names this process: a client that sees it change knows the server restarted
        # (back to its version 0 weights and empty counters) and does not mistake it for itself.
        self.server_id = uuid.uuid4().hex
        self._runner: web.AppRunner | None = None
        self._update_lock = asyncio.Lock()

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    def build(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_mb * 1024 * 1024)
        app.router.add_post(wire.GENERATE, self.generate)
        app.router.add_post(wire.UPDATE_WEIGHTS, self.update_weights)
        app.router.add_get(wire.WEIGHT_INFO, self.weight_info)
        app.router.add_get(wire.WEIGHTS, self.weights)
        app.router.add_post(wire.ABORT, self.abort)
        app.router.add_post(wire.RELEASE, self.release)
        app.router.add_get(wire.HEALTH, self.health)
        app.router.add_get(wire.STATS, self.stats)
        return app

    async def start(self) -> int:
        """Start the engine, bind and serve; returns the bound port (a free one when port is 0)."""
        await self.engine.start()
        self._runner = web.AppRunner(self.build(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port, backlog=1024)
        await site.start()
        server = site._server  # aiohttp exposes no public accessor for the bound port
        assert isinstance(server, asyncio.base_events.Server)
        self.port = int(server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        """Abort what is in flight (those calls answer with finish_reason 'abort'), then unbind."""
        await self.engine.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _state(self) -> dict[str, float]:
        return self.engine.stats()

    # ----------------------------------------------------------------- routes
    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = msgspec.json.decode(await request.read(), type=wire.GenerateBody)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return _error(400, f"generate: {exc}", "invalid_request")
        req = GenerationRequest(
            request_id=body.request_id,
            prompt_ids=body.token_ids,
            params=body.sampling_params,
            session_id=body.session_id,
        )
        try:
            res = await self.engine.generate(req)
        except EngineError as exc:
            return _error(503, f"engine failed: {exc.__cause__ or exc!r}", "engine_failed")
        except ValueError as exc:
            status = 409 if "already in flight" in str(exc) else 400
            return _error(status, str(exc), "conflict" if status == 409 else "invalid_request")
        except RuntimeError as exc:  # stopped: the server is shutting down
            return _error(503, str(exc), "unavailable")
        choice = wire.Choice(
            token_ids=res.completion_ids, logprobs=res.logprobs, finish_reason=res.finish_reason, segments=res.segments
        )
        return _json(
            wire.GenerateAnswer(
                request_id=res.request_id,
                prompt_token_ids=res.prompt_ids,
                choices=[choice],
                timings=res.timings,
                policy_version=self.engine.policy_version,
                stats=self._state(),
                server_id=self.server_id,
            )
        )

    async def update_weights(self, request: web.Request) -> web.Response:
        raw = request.query.get("version", "")
        try:
            version = int(raw)
        except ValueError:
            return _error(
                400, f"update_weights: query parameter version must be an int, got {raw!r}", "invalid_request"
            )
        data = await request.read()
        try:
            tensors = await asyncio.to_thread(st_load, data)
        except Exception as exc:  # safetensors raises its own SafetensorError on a malformed body
            return _error(400, f"update_weights: body is not a safetensors file: {exc}", "invalid_weights")
        async with self._update_lock:
            before = self.engine.stats()["weight_updates"]
            try:
                self.engine.apply_weights(version, tensors)
            except ValueError as exc:
                return _error(400, str(exc), "invalid_weights")
            deadline = time.monotonic() + self.cfg.apply_timeout_s
            while self.engine.stats()["weight_updates"] <= before:
                if self.engine.error is not None:
                    return _error(
                        503, f"engine failed while applying version {version}: {self.engine.error!r}", "engine_failed"
                    )
                if time.monotonic() >= deadline:
                    return _error(504, f"version {version} not applied within {self.cfg.apply_timeout_s}s", "timeout")
                await asyncio.sleep(_APPLY_POLL_S)
        stats = self._state()
        log.info("weights updated over http", policy_version=version, apply_ms=round(stats["last_weight_apply_ms"], 2))
        return _json(
            wire.UpdateAnswer(
                policy_version=self.engine.policy_version,
                apply_ms=stats["last_weight_apply_ms"],
                stats=stats,
                server_id=self.server_id,
            )
        )

    async def weight_info(self, request: web.Request) -> web.Response:
        specs = param_specs(self.engine.model)
        return _json(
            wire.WeightInfo(
                policy_version=self.engine.policy_version,
                parameters={n: wire.ParamInfo(shape=list(s.shape), dtype=s.dtype) for n, s in specs.items()},
                aliases=tied_aliases(self.engine.model),
                partial=self.engine.allow_partial_updates,
                stats=self._state(),
                server_id=self.server_id,
            )
        )

    async def weights(self, request: web.Request) -> web.Response:
        """Every parameter as safetensors (a copy: what `HttpEngine.state_dict()` returns)."""
        for _ in range(_SNAPSHOT_TRIES):
            before = self.engine.stats()["weight_updates"]
            version = self.engine.policy_version
            data = await asyncio.to_thread(self._snapshot)
            if self.engine.stats()["weight_updates"] == before and self.engine.pending_version is None:
                return web.Response(
                    body=data,
                    content_type="application/octet-stream",
                    headers={"x-slipstream-policy-version": str(version)},
                )
        return _error(503, f"weights kept changing during {_SNAPSHOT_TRIES} snapshots; retry", "busy")

    def _snapshot(self) -> bytes:
        params = {n: p.detach().to("cpu", copy=True).contiguous() for n, p in self.engine.model.named_parameters()}
        return st_save(params)

    async def abort(self, request: web.Request) -> web.Response:
        try:
            body = msgspec.json.decode(await request.read(), type=wire.AbortBody)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return _error(400, f"abort_requests: {exc}", "invalid_request")
        found = [rid for rid in body.request_ids if self.engine.abort(rid)]
        return _json({"aborted": found})

    async def release(self, request: web.Request) -> web.Response:
        try:
            body = msgspec.json.decode(await request.read(), type=wire.ReleaseBody)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return _error(400, f"release_session: {exc}", "invalid_request")
        self.engine.release(body.session_id)
        return _json({"released": body.session_id})

    async def health(self, request: web.Request) -> web.Response:
        if self.engine.error is not None:
            return _error(503, f"engine loop failed: {self.engine.error!r}", "engine_failed")
        return _json({"status": "ok", "policy_version": self.engine.policy_version})

    async def stats(self, request: web.Request) -> web.Response:
        return _json({"policy_version": self.engine.policy_version, "stats": self._state()})
