"""vLLM's token-in, token-out route, `POST /inference/v1/generate`, over the recording endpoint.

Clients that render prompts themselves (verifiers' training client through the `renderers`
package, prime-rl's orchestrator) send token ids and read back the exact sampled ids and their
log-probs. The shape is vLLM's (its `--enable-scale-out` generate route):

    request:  {"model", "token_ids": [...], "sampling_params": {"max_tokens", "temperature",
               "top_p", "top_k", "seed", "stop", "stop_token_ids", "logprobs", "n", ...}}
              headers: X-Session-ID names the rollout (the session its calls are recorded in)
    response: {"request_id", "prompt_token_ids", "choices": [{"index", "token_ids",
               "logprobs": {"content": [{"token": "token_id:<id>", "logprob"}]},
               "finish_reason"}], "usage", "slipstream": {call_id, session_id, policy_segments}}

A call is served and recorded exactly like a completions call with token ids (`ServeApp._serve`):
same admission, sessions, retry coalescing and episode assembly, so a multi-turn rollout whose
every prompt extends the previous context is one sample with its observations at mask 0.

`n` > 1 samples n completions of the one prompt in one call, each its own rollout and episode
in one group (group.py, shared with the OpenAI routes); `x-slipstream-group` in the response
names the group.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from aiohttp import web

from slipstream.engine.interface import SamplingParams
from slipstream.serve.call_record import CallRecord
from slipstream.serve.chat import ChatFormat
from slipstream.serve.group import GROUP_HEADER, Serving, serve_group
from slipstream.serve.protocol import MAX_N, Call, RequestError

ROUTE = "/inference/v1/generate"

# vLLM sampling fields that change nothing here (or describe the response shape we always give).
_HARMLESS = {
    "logprobs",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "detokenize",
    "include_stop_str_in_output",
    "routed_experts_prompt_start",
    "output_kind",
    "prompt_logprobs",
}
# Fields whose neutral value is accepted and any other value refused (no silent emulation).
_NEUTRAL: dict[str, Any] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "min_tokens": 0,
    "logit_bias": None,
    "bad_words": None,
    "allowed_token_ids": None,
    "structured_outputs": None,
    "guided_decoding": None,
}
_SAMPLING = {"n", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos"}


def _number(sp: dict[str, Any], key: str, default: float) -> float:
    value = sp.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(f"'sampling_params.{key}' must be a finite number, got {value!r}", param=key)
    return float(value)


def _int(sp: dict[str, Any], key: str, default: int | None) -> int | None:
    value = sp.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'sampling_params.{key}' must be an integer, got {value!r}", param=key)
    return value


def parse_sampling(
    sp: Any, *, default_max_tokens: int, max_tokens_limit: int, vocab: int | None
) -> tuple[int, SamplingParams]:
    """(n, the engine's parameters) from vLLM's `sampling_params`; a 400 naming the field otherwise."""
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise RequestError("'sampling_params' must be an object", param="sampling_params")
    unknown = sorted(set(sp) - _HARMLESS - set(_NEUTRAL) - _SAMPLING)
    if unknown:
        raise RequestError(
            f"'sampling_params' has fields this endpoint does not serve: {unknown}; "
            f"served: {sorted(_SAMPLING | _HARMLESS)}",
            param="sampling_params",
        )
    for key, neutral in _NEUTRAL.items():
        if key in sp and sp[key] not in (neutral, None) and not (neutral is None and not sp[key]):
            raise RequestError(f"'sampling_params.{key}' = {sp[key]!r} is not supported (only {neutral!r})", param=key)
    n = _int(sp, "n", 1)
    assert n is not None
    if not 1 <= n <= MAX_N:
        raise RequestError(f"'sampling_params.n' must be in [1, {MAX_N}], got {n}", param="n")
    max_tokens = _int(sp, "max_tokens", default_max_tokens)
    assert max_tokens is not None
    if not 1 <= max_tokens <= max_tokens_limit:
        raise RequestError(
            f"'sampling_params.max_tokens' must be in [1, {max_tokens_limit}], got {max_tokens}", param="max_tokens"
        )
    temperature = _number(sp, "temperature", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise RequestError(f"'sampling_params.temperature' must be in [0, 2], got {temperature}", param="temperature")
    top_p = _number(sp, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise RequestError(f"'sampling_params.top_p' must be in (0, 1], got {top_p}", param="top_p")
    top_k = _int(sp, "top_k", 0)
    top_k = 0 if top_k is None or top_k == -1 else top_k  # vLLM spells "no top-k" -1
    if top_k < 0:
        raise RequestError(f"'sampling_params.top_k' must be -1, 0 or positive, got {top_k}", param="top_k")
    stop = sp.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("'sampling_params.stop' must be a non-empty string or a list of them", param="stop")
    stop_ids = sp.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise RequestError("'sampling_params.stop_token_ids' must be a list of token ids", param="stop_token_ids")
    if vocab is not None and any(not 0 <= t < vocab for t in stop_ids):
        raise RequestError(f"'sampling_params.stop_token_ids' has ids outside [0, {vocab})", param="stop_token_ids")
    ignore_eos = sp.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise RequestError("'sampling_params.ignore_eos' must be a boolean", param="ignore_eos")
    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_tokens=max_tokens,
        stop=list(stop),
        stop_token_ids=list(stop_ids),
        seed=_int(sp, "seed", None),
        ignore_eos=ignore_eos,
    )
    return n, params


def parse_generate(body: Any, *, default_max_tokens: int, max_tokens_limit: int, vocab: int | None) -> tuple[int, Call]:
    """(n, the validated call) of one generate request body."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("'model' is required (a string naming a served model, see /v1/models)", param="model")
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise RequestError("'token_ids' must be a non-empty list of token ids (the rendered prompt)", param="token_ids")
    if vocab is not None and any(not 0 <= t < vocab for t in ids):
        raise RequestError(f"'token_ids' has ids outside the vocabulary [0, {vocab})", param="token_ids")
    for refused in ("features", "content_parts"):
        if body.get(refused):
            raise RequestError(f"'{refused}' (multimodal input) is not served here", param=refused)
    session = body.get("session_id", "")
    if not isinstance(session, str):
        raise RequestError("'session_id' must be a string", param="session_id")
    n, params = parse_sampling(
        body.get("sampling_params"),
        default_max_tokens=default_max_tokens,
        max_tokens_limit=max_tokens_limit,
        vocab=vocab,
    )
    return n, Call(endpoint="generate", model=model, params=params, prompt_ids=list(ids), session_id=session)


def choice_body(index: int, ids: list[int], logprobs: list[float], finish_reason: str) -> dict[str, Any]:
    """One choice in vLLM's shape: exact ids, and log-probs keyed by id (`token_id:<id>`)."""
    content = [{"token": f"token_id:{t}", "logprob": lp} for t, lp in zip(ids, logprobs, strict=True)]
    return {"index": index, "token_ids": list(ids), "logprobs": {"content": content}, "finish_reason": finish_reason}


def render_choice(index: int, record: CallRecord) -> dict[str, Any]:
    """A recorded call as one choice."""
    return choice_body(index, record.completion_ids, record.logprobs, record.finish_reason)


def render_generate(records: list[CallRecord]) -> dict[str, Any]:
    """The response body for one prompt's n records (in choice order)."""
    first = records[0]
    prompt = len(first.prompt_ids)
    completion = sum(len(r.completion_ids) for r in records)
    return {
        "request_id": f"gen-{first.call_id}",
        "prompt_token_ids": list(first.prompt_ids),
        "choices": [render_choice(i, r) for i, r in enumerate(records)],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        "slipstream": {
            "call_ids": [r.call_id for r in records],
            "session_ids": [r.session_id for r in records],
            "policy_segments": [[list(s) for s in r.segments] for r in records],
        },
    }


class Endpoint(Serving, Protocol):
    """What the route shares with the endpoint it is mounted on (`app.ServeApp`)."""

    fmt: ChatFormat
    limits: dict[str, int]

    def _auth(self, request: web.Request) -> str: ...
    def _admit(self) -> None: ...
    async def _body(self, request: web.Request) -> tuple[Any, bytes]: ...
    def _check_model(self, call: Call) -> None: ...
    def _headers(self, record: CallRecord, replayed: bool) -> dict[str, str]: ...


class GenerateRoute:
    """The route's handler, sharing the endpoint's state (engine, recorder, admission)."""

    def __init__(self, app: Endpoint) -> None:
        self.app = app

    async def handle(self, request: web.Request) -> web.Response:
        app = self.app
        key = app._auth(request)
        app._admit()
        body, raw = await app._body(request)
        vocab = getattr(app.fmt.tokenizer, "vocab_size", None)
        n, call = parse_generate(body, vocab=vocab, **app.limits)
        app._check_model(call)
        prompt_ids = list(call.prompt_ids or [])
        if n == 1:
            record, replayed = await app._serve(request, call, raw, key, prompt_ids, "token_ids")
            headers = app._headers(record, replayed)
            return web.json_response(render_generate([record]), headers=headers)
        records, replayed, group = await serve_group(app, request, call, raw, key, prompt_ids, "token_ids", n)
        headers = app._headers(records[0], replayed)
        headers[GROUP_HEADER] = group
        return web.json_response(render_generate(records), headers=headers)
