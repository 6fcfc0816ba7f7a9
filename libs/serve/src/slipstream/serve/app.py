"""The OpenAI-compatible endpoint: aiohttp routes over the engine, every call recorded.

    POST /v1/chat/completions   (stream or not; tools rendered by the renderer, calls parsed back)
    POST /v1/completions        (prompt text or token ids)
    POST /v1/feedback           (a signal for a served completion, session or episode)
    POST /inference/v1/generate (vLLM's token-in, token-out route; generate.py)
    GET  /v1/models, GET /v1/models/{model}, GET /health

A call: admission (429 with Retry-After while the learner's newest version is more than
`max_version_lag` ahead of the served one) → validate (4xx naming the field) → resolve its
session (`X-Session-ID` header, then body `session_id`, then the bearer key) → coalesce SDK
retries (`Idempotency-Key`, or `x-stainless-retry-count` > 0 with the same body: the recorded
call is replayed, not resampled) →
implicit signals for the session's previous call (`slipstream.serve.feedback`) →
`engine.generate` → record (`slipstream.serve.record`) → respond. Every response names the
policy version of its newest token in `x-slipstream-policy-version`, and carries the call's
per-token version segments under `slipstream` in the body. A call with `n` > 1 (any of the three
generating routes) is n such calls of its one prompt, each its own session and episode, one
group (`slipstream.serve.group`).

A streamed chat call without tools, on an engine that shows a running request's tokens
(`TorchEngine.progress`), is written as its tokens are sampled (`slipstream.serve.live`). Any
other stream is a replay: the SSE chunks (one per token, role first, finish, then usage when
`stream_options.include_usage`) are written once the completion is done; exact, but the time to
first token is then the whole generation.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from slipstream.control import ControlUnavailable
from slipstream.engine.interface import Engine, GenerationRequest
from slipstream.serve.call_record import CallRecord
from slipstream.serve.chat import ChatFormat, Reply
from slipstream.serve.config import ServeConfig
from slipstream.serve.feedback import FeedbackPost, Implicit, last_user_text, parse_feedback
from slipstream.serve.generate import ROUTE as GENERATE_ROUTE
from slipstream.serve.generate import GenerateRoute
from slipstream.serve.group import GROUP_HEADER, request_group, serve_group
from slipstream.serve.live import stream_chat
from slipstream.serve.protocol import Call, RequestError, body_hash, parse_chat, parse_completion
from slipstream.serve.record import Recorder
from slipstream.serve.render import completion_text, render_chat, render_completion, sse_chat, sse_completion
from slipstream.serve.top_logprobs import Alternatives, top_alternatives
from slipstream.telemetry.logs import get_logger
from slipstream.telemetry.metrics import REGISTRY

log = get_logger(__name__)

VERSION_HEADER = "x-slipstream-policy-version"
REQUESTS = REGISTRY.counter("worker/serve/requests", "Endpoint requests by route and status code.")
RECORDED = REGISTRY.counter("worker/serve/calls_recorded", "Served calls recorded, by endpoint.")
COALESCED = REGISTRY.counter("worker/serve/retries_coalesced", "SDK retries answered by replaying a recorded call.")
CALL_S = REGISTRY.histogram("worker/serve/call_s", "Seconds from request to response body, by endpoint.")
FEEDBACK = REGISTRY.counter("worker/serve/feedback", "Feedback signals posted or implied, by source kind and outcome.")
ADMISSION = REGISTRY.counter("worker/serve/admission_refused", "Calls answered 429: served version too far behind.")


class ServeApp:
    """The routes and the state they share (engine, chat format, recorder)."""

    def __init__(
        self,
        engine: Engine,
        fmt: ChatFormat,
        recorder: Recorder,
        cfg: ServeConfig,
        model_name: str,
        *,
        newest_version: Callable[[], int] | None = None,
    ) -> None:
        self.engine = engine
        # The learner's newest policy version as this process knows it (admission control).
        self.newest_version = newest_version
        self.implicit = Implicit(cfg.followup_signal, cfg.dissatisfied_signal, cfg.dissatisfied_patterns)
        self.admission_refused = 0
        self.implicit_late = 0
        self.fmt = fmt
        self.recorder = recorder
        self.cfg = cfg
        self.model_name = model_name
        self.limits = {"default_max_tokens": cfg.default_max_tokens, "max_tokens_limit": cfg.max_tokens_limit}
        self.keys = set(cfg.api_keys)

    def build(self, middlewares: list[Any] | None = None) -> web.Application:
        app = web.Application(middlewares=[*(middlewares or []), self._errors], client_max_size=16 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/feedback", self.feedback)
        app.router.add_post(GENERATE_ROUTE, GenerateRoute(self).handle)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_get("/health", self.health)
        return app

    # ------------------------------------------------------------------ plumbing
    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
        try:
            resp = await handler(request)
        except RequestError as err:
            resp = web.json_response(err.body(), status=err.status, headers=err.headers)
        except ControlUnavailable as exc:
            # The pending store (Redis) is away: nothing was recorded for this request; retryable.
            log.warning("serve: pending store unavailable", route=route, error=str(exc))
            away = RequestError(f"feedback state unavailable: {exc}; retry", status=503, kind="server_error")
            resp = web.json_response(away.body(), status=503, headers={"Retry-After": "1"})
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
            refused = RequestError(f"{request.method} {request.path}: {exc.reason}", status=exc.status, kind=kind)
            resp = web.json_response(refused.body(), status=exc.status)
        except Exception as exc:
            # The engine failed (or a bug): a 500 in OpenAI's shape, which the client retries.
            log.exception("serve: call failed", route=route)
            failed = RequestError(f"internal error: {exc!r}", status=500, kind="server_error")
            resp = web.json_response(failed.body(), status=500)
        REQUESTS.add(1, route=route, status=str(resp.status))
        return resp

    def _auth(self, request: web.Request) -> str:
        """The bearer key ('' when none); with `api_keys` configured, an unknown key is a 401."""
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if self.keys and key not in self.keys:
            raise RequestError("invalid API key", status=401, kind="authentication_error", code="invalid_api_key")
        return key

    async def _body(self, request: web.Request) -> tuple[Any, bytes]:
        raw = await request.read()
        try:
            return json.loads(raw), raw
        except ValueError as exc:
            raise RequestError(f"the request body is not valid JSON: {exc}") from None

    def _session(self, request: web.Request, call: Call, key: str) -> str:
        header = request.headers.get("X-Session-ID", "").strip()
        if header:
            return header
        if call.session_id:
            return call.session_id
        if key:
            # The key names the session; only a digest of it is ever stored.
            return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]
        return "anon-" + uuid.uuid4().hex[:16]

    def _retry_key(self, request: web.Request, raw: bytes) -> tuple[str, bool]:
        """(ledger key, whether an earlier call under it may answer this one)."""
        idem = request.headers.get("Idempotency-Key", "").strip()
        if idem:
            return "idem:" + idem, True
        try:
            retries = int(request.headers.get("x-stainless-retry-count", "0"))
        except ValueError:
            retries = 0
        return "body:" + body_hash(raw), retries > 0

    # ------------------------------------------------------------------ routes
    async def health(self, request: web.Request) -> web.Response:
        error = getattr(self.engine, "error", None)
        if error is not None:
            return web.json_response({"status": "failed", "error": repr(error)}, status=503)
        return web.json_response({"status": "ok", "policy_version": self.engine.policy_version})

    async def models(self, request: web.Request) -> web.Response:
        self._auth(request)
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        """`GET /v1/models/{model}` (the SDK's `models.retrieve`): the served model, else 404 naming it."""
        self._auth(request)
        name = request.match_info["model"]
        if name != self.model_name:
            raise RequestError(
                f"model {name!r} is not served here; this endpoint serves {self.model_name!r}",
                param="model",
                status=404,
                kind="not_found_error",
                code="model_not_found",
            )
        return web.json_response(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "slipstream"}

    async def chat(self, request: web.Request) -> web.StreamResponse:
        key = self._auth(request)
        self._admit()
        body, raw = await self._body(request)
        call = parse_chat(body, **self.limits)
        self._check_model(call)
        tools = self.fmt.registry(call.tools) if call.tool_choice != "none" else None
        messages = self.fmt.messages(call.messages)
        text = self.fmt.prompt_text(
            messages,
            tools,
            add_generation_prompt=call.add_generation_prompt,
            continue_final_message=call.continue_final_message,
        )
        prompt_ids = self.fmt.encode(text)
        call.params.stop = [*call.params.stop, *(s for s in self.fmt.stop_strings if s not in call.params.stop)]
        user_text = last_user_text(body["messages"])

        def reply_of(record: CallRecord) -> Reply:
            cut = completion_text(record, self.fmt)
            return self.fmt.reply(
                record.text, cut, record.finish_reason, tools, call_prefix=f"call_{record.call_id[:12]}"
            )

        async def replay(record: CallRecord, replayed: bool) -> web.StreamResponse:
            headers = self._headers(record, replayed)
            return await sse_chat(request, self.model_name, [record], [reply_of(record)], call, self.fmt, headers)

        progress = getattr(self.engine, "progress", None)
        live = call.stream and call.n == 1 and tools is None and not call.top_logprobs
        if live and callable(progress):  # as sampled (live.py)
            return await stream_chat(
                request,
                progress=progress,
                serve=lambda cid: self._serve(request, call, raw, key, prompt_ids, "messages", user_text, cid),
                finish=reply_of,
                replay=replay,
                call=call,
                fmt=self.fmt,
                model=self.model_name,
                version=self.engine.policy_version,
            )
        records, headers = await self._serve_n(request, call, raw, key, prompt_ids, "messages", user_text)
        replies = [reply_of(r) for r in records]
        tops: list[Alternatives | None] | None = None
        if call.top_logprobs:
            computed = [await top_alternatives(self.engine, r, call.top_logprobs) for r in records]
            tops = [alternatives for alternatives, _ in computed]
            headers["x-slipstream-top-logprobs-version"] = ",".join(str(v) for _, v in computed)
        if call.stream:
            return await sse_chat(request, self.model_name, records, replies, call, self.fmt, headers, tops)
        return web.json_response(render_chat(self.model_name, records, replies, call, self.fmt, tops), headers=headers)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        key = self._auth(request)
        self._admit()
        body, raw = await self._body(request)
        call = parse_completion(body, **self.limits)
        self._check_model(call)
        if call.prompt_ids is not None:
            vocab = getattr(self.fmt.tokenizer, "vocab_size", None)
            if vocab is not None and any(not 0 <= t < vocab for t in call.prompt_ids):
                raise RequestError(f"'prompt' has token ids outside the vocabulary [0, {vocab})", param="prompt")
            prompt_ids = call.prompt_ids
        else:
            prompt_ids = self.fmt.encode(call.prompt_text or "")
        records, headers = await self._serve_n(request, call, raw, key, prompt_ids, "prompt")
        if call.stream:
            return await sse_completion(request, self.model_name, records, call, self.fmt, headers)
        return web.json_response(render_completion(self.model_name, records, call, self.fmt), headers=headers)

    async def feedback(self, request: web.Request) -> web.Response:
        """`POST /v1/feedback`: 200 recorded / duplicate, 404 unknown target, 409 already released."""
        self._auth(request)
        body, _ = await self._body(request)
        post = parse_feedback(body, now=time.time())
        episode_id = await self._resolve(post)
        verdict = await self.recorder.pending.add_feedback(episode_id, post.signal, time.time())
        FEEDBACK.add(1, source="implicit" if post.signal.source == "implicit" else "posted", outcome=verdict)
        if verdict == "unknown":
            raise self._unknown(post)
        if verdict == "too_late":
            raise RequestError(
                f"episode {episode_id!r} was already released (or masked at its deadline); feedback comes too late",
                param=post.kind,
                status=409,
                code="episode_released",
            )
        return web.json_response({"status": verdict, "feedback_id": post.signal.feedback_id, "episode_id": episode_id})

    async def _resolve(self, post: FeedbackPost) -> str:
        """The episode a post's target was served into; 404 naming the target when there is none."""
        pending = self.recorder.pending
        if post.kind == "episode_id":
            if await pending.state(post.target_id) is None:
                raise self._unknown(post)
            return post.target_id
        call_id = post.target_id if post.kind == "completion_id" else await pending.last_call(post.target_id)
        episode_id = await pending.episode_of_call(call_id) if call_id else None
        if episode_id is None:
            raise self._unknown(post)
        return episode_id

    def _unknown(self, post: FeedbackPost) -> RequestError:
        what = post.kind.removesuffix("_id")
        return RequestError(
            f"no served {what} {post.target_id!r} is known here (or it is older than feedback_retention_s)",
            param=post.kind,
            status=404,
            kind="not_found_error",
            code=f"{what}_not_found",
        )

    # ------------------------------------------------------------------ one call
    def _admit(self) -> None:
        """Refuse (429, Retry-After) while the served version lags the learner's by more than the bound."""
        bound = self.cfg.max_version_lag
        if bound <= 0 or self.newest_version is None:
            return
        newest, served = self.newest_version(), self.engine.policy_version
        if newest - served <= bound:
            return
        self.admission_refused += 1
        ADMISSION.add(1)
        wait = self.cfg.retry_after_s
        raise RequestError(
            f"the served policy (version {served}) lags the learner's newest (version {newest}) by more than "
            f"{bound}; retry after {wait:g}s",
            status=429,
            kind="rate_limit_error",
            code="policy_version_lag",
            headers={
                "Retry-After": str(max(1, round(wait))),
                "retry-after-ms": str(int(wait * 1000)),
                VERSION_HEADER: str(served),
            },
        )

    async def _implicit(self, session: str, user_text: str) -> None:
        """The session's previous call earns its implicit signals from this call's user message."""
        pending = self.recorder.pending
        prev = await pending.last_call(session)
        episode_id = await pending.episode_of_call(prev) if prev else None
        if prev is None or episode_id is None:
            return
        for signal in self.implicit.signals(prev, user_text, now=time.time()):
            verdict = await pending.add_feedback(episode_id, signal, time.time())
            FEEDBACK.add(1, source="implicit", outcome=verdict)
            if verdict == "too_late":
                self.implicit_late += 1

    def _check_model(self, call: Call) -> None:
        if call.model != self.model_name:
            raise RequestError(
                f"model {call.model!r} is not served here; this endpoint serves {self.model_name!r}",
                param="model",
                status=404,
                kind="not_found_error",
                code="model_not_found",
            )

    def _headers(self, record: CallRecord, replayed: bool) -> dict[str, str]:
        version = record.newest_version if record.segments else self.engine.policy_version
        return {
            VERSION_HEADER: str(version),
            "x-slipstream-call-id": record.call_id,
            "x-slipstream-session-id": record.session_id,
            "x-slipstream-replayed": "true" if replayed else "false",
            **({GROUP_HEADER: record.group_key} if record.group_key else {}),
        }

    async def _serve_n(
        self,
        request: web.Request,
        call: Call,
        raw: bytes,
        key: str,
        prompt_ids: list[int],
        prompt_param: str,
        user_text: str | None = None,
    ) -> tuple[list[CallRecord], dict[str, str]]:
        """The call's `n` records (one, or a group: group.py) and its response headers."""
        if call.n == 1:
            record, replayed = await self._serve(request, call, raw, key, prompt_ids, prompt_param, user_text)
            return [record], self._headers(record, replayed)
        records, replayed, group = await serve_group(
            self, request, call, raw, key, prompt_ids, prompt_param, call.n, user_text
        )
        headers = self._headers(records[0], replayed)
        headers[GROUP_HEADER] = group
        return records, headers

    async def _serve(
        self,
        request: web.Request,
        call: Call,
        raw: bytes,
        key: str,
        prompt_ids: list[int],
        prompt_param: str,
        user_text: str | None = None,
        call_id: str = "",
        *,
        session: str | None = None,
        group: tuple[str, int] | None = None,
    ) -> tuple[CallRecord, bool]:
        """The call's record: served now, or an earlier attempt's replayed. Returns (record, replayed).

        `session` overrides the request's own (one member of an `n` > 1 generate call), and
        `group` the prompt group its headers name (`x-slipstream-group`, generate.py)."""
        max_len = getattr(self.engine, "max_seq_len", None)
        if max_len is not None and len(prompt_ids) >= max_len:
            raise RequestError(
                f"'{prompt_param}' renders to {len(prompt_ids)} tokens; this model takes at most {max_len - 1}",
                param=prompt_param,
                code="context_length_exceeded",
            )
        group_key, group_size = group if group is not None else request_group(request.headers)
        session = session or self._session(request, call, key)
        # An anonymous call is a session of its own, but its retry must still find it.
        scope = "anon" if session.startswith("anon-") else session
        ledger_key, lookup = self._retry_key(request, raw)
        prior = self.recorder.begin(scope, ledger_key) if lookup else None
        if prior is not None:
            record = await prior
            COALESCED.add(1)
            return record, True
        if not lookup:
            self.recorder.begin(scope, ledger_key, replace=True)
        if user_text is not None and scope != "anon" and self.implicit.enabled:
            try:
                await self._implicit(session, user_text)
            except Exception as exc:  # the pending store away: the call is still served
                log.warning("serve: implicit signals not recorded", session=session, error=repr(exc))
        started = time.time()
        call_id = call_id or uuid.uuid4().hex
        try:
            res = await self.engine.generate(
                GenerationRequest(request_id=call_id, prompt_ids=prompt_ids, params=call.params)
            )
        except Exception as exc:
            self.recorder.fail(scope, ledger_key, exc)
            raise
        if res.finish_reason == "abort":
            err = RequestError("the engine is stopping; retry", status=503, kind="server_error", code="engine_stopping")
            self.recorder.fail(scope, ledger_key, err)
            raise err
        record = CallRecord(
            call_id=call_id,
            session_id=session,
            endpoint=call.endpoint,
            model=self.model_name,
            created=started,
            finished_at=time.time(),
            prompt_ids=list(res.prompt_ids),
            completion_ids=list(res.completion_ids),
            logprobs=list(res.logprobs),
            segments=[(int(v), int(n)) for v, n in res.segments],
            finish_reason=res.finish_reason,
            params=call.params,
            template_hash=self.fmt.template_hash if call.endpoint == "chat" else "",
            text=self.fmt.tokenizer.decode(res.completion_ids),
            task_text=user_text if user_text is not None else (call.prompt_text or ""),
            request_hash=body_hash(raw),
            retry_key=ledger_key,
            group_key=group_key,
            group_size=group_size,
        )
        try:
            await self.recorder.record(record)
        except Exception as exc:
            self.recorder.fail(scope, ledger_key, exc)
            raise
        self.recorder.finish(scope, ledger_key, record)
        RECORDED.add(1, endpoint=call.endpoint)
        CALL_S.observe(record.finished_at - started, endpoint=call.endpoint)
        return record, False
