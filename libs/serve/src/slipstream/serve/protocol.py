"""The OpenAI wire surface: request validation into typed calls, and OpenAI-shaped errors.

Only what the endpoint serves is accepted, and everything else is refused by name, because a
silently ignored field (say `logit_bias`) would hand the client something other
than what it asked for and record data nobody can interpret later. Unknown *extra* keys are
tolerated (clients send `user`, `metadata`, `store`, ...), as OpenAI-compatible servers do.

An error is `{"error": {"message", "type", "param", "code"}}` with a 4xx status, the shape the
`openai` client turns into `BadRequestError` / `NotFoundError` with `.param` set.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from slipstream.engine.interface import SamplingParams

MAX_TOP_LOGPROBS = 20  # OpenAI's bound
MAX_N = 64  # completions of one prompt in one call (each its own recorded rollout)


class RequestError(Exception):
    """A request the endpoint refuses; `param` names the offending field."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.kind = kind
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Call:
    """One validated request, either endpoint: what to render and how to sample."""

    endpoint: str  # "chat" | "completions"
    model: str
    params: SamplingParams
    n: int = 1  # completions of the prompt; n > 1 serves each as its own rollout (group.py)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # chat: the k likeliest tokens at each position, beside the sampled one
    return_token_ids: bool = False
    session_id: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    body_hash: str = ""


def body_hash(raw: bytes) -> str:
    """Identity of a request body for retry coalescing: sha256 of its canonical JSON."""
    try:
        canonical = json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
    except ValueError:
        canonical = raw
    return hashlib.sha256(canonical).hexdigest()


def _get(body: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    # bool is an int subclass: `max_tokens: true` is an error, not 1.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise RequestError(f"'{key}' must be {_kind_name(kind)}, got {value!r}", param=key)
    if not isinstance(value, kind):
        raise RequestError(f"'{key}' must be {_kind_name(kind)}, got {type(value).__name__}", param=key)
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def sampling_params(body: dict[str, Any], *, default_max_tokens: int, max_tokens_limit: int) -> SamplingParams:
    """The engine's sampling parameters from OpenAI fields (plus vLLM's `top_k` / `ignore_eos` extras)."""
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _get(body, param, int, default_max_tokens)
    if not 1 <= max_tokens <= max_tokens_limit:
        raise RequestError(f"'{param}' must be in [1, {max_tokens_limit}], got {max_tokens}", param=param)
    temperature = float(_get(body, "temperature", (int, float), 1.0))
    if not 0.0 <= temperature <= 2.0:
        raise RequestError(f"'temperature' must be in [0, 2], got {temperature}", param="temperature")
    top_p = float(_get(body, "top_p", (int, float), 1.0))
    if not 0.0 < top_p <= 1.0:
        raise RequestError(f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    top_k = _get(body, "top_k", int, 0)
    if top_k < 0:
        raise RequestError(f"'top_k' must be >= 0, got {top_k}", param="top_k")
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stops = list(stop)
    else:
        raise RequestError("'stop' must be a string or an array of at most 4 strings", param="stop")
    if any(not s for s in stops):
        raise RequestError("'stop' must not contain an empty string", param="stop")
    seed = _get(body, "seed", int)
    for unsupported in ("presence_penalty", "frequency_penalty"):
        if body.get(unsupported) not in (None, 0, 0.0):
            raise RequestError(f"'{unsupported}' is not supported (only 0)", param=unsupported)
    if body.get("logit_bias"):
        raise RequestError("'logit_bias' is not supported", param="logit_bias")
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_tokens=max_tokens,
        stop=stops,
        seed=seed,
        ignore_eos=bool(_get(body, "ignore_eos", bool, False)),
    )


def _common(body: dict[str, Any], endpoint: str, **limits: int) -> Call:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("'model' is required (a string naming a served model, see /v1/models)", param="model")
    stream = bool(_get(body, "stream", bool, False))
    options = _get(body, "stream_options", dict, {})
    if options and not stream:
        raise RequestError("'stream_options' is only allowed with 'stream': true", param="stream_options")
    session = _get(body, "session_id", str, "")
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise RequestError(f"'n' must be in [1, {MAX_N}], got {n}", param="n")
    call = Call(
        endpoint=endpoint,
        model=model,
        params=sampling_params(body, **limits),
        n=n,
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        return_token_ids=bool(_get(body, "return_token_ids", bool, False)),
        session_id=session,
    )
    return call


def parse_chat(body: Any, **limits: int) -> Call:
    """A validated `/v1/chat/completions` body."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' is required: a non-empty array of chat messages", param="messages")
    call = _common(body, "chat", **limits)
    call.messages = messages
    tools = _get(body, "tools", list, [])
    call.tools = tools
    call.tool_choice = body.get("tool_choice")
    if call.tool_choice not in (None, "auto", "none"):
        raise RequestError("'tool_choice' must be 'auto' or 'none' (forced calls are not served)", param="tool_choice")
    _prompt_end(body, messages, call)
    call.logprobs = bool(_get(body, "logprobs", bool, False))
    top = _get(body, "top_logprobs", int, 0)
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise RequestError(f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {top}", param="top_logprobs")
    if top and not call.logprobs:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    call.top_logprobs = top
    fmt = _get(body, "response_format", dict, {})
    if fmt and fmt.get("type") != "text":
        raise RequestError("'response_format' other than 'text' is not supported", param="response_format")
    return call


def _prompt_end(body: dict[str, Any], messages: list[Any], call: Call) -> None:
    """vLLM's `continue_final_message` / `add_generation_prompt` extras: how the rendered prompt ends.

    `continue_final_message: true` leaves the last message (an assistant one: the prefill) open,
    without its end of turn, so the model continues it; `add_generation_prompt` then defaults to
    false (vLLM requires it false; here an explicit true is the only conflict refused).
    `add_generation_prompt: false` alone renders the conversation without the assistant opener.
    """
    cont = bool(_get(body, "continue_final_message", bool, False))
    gen = _get(body, "add_generation_prompt", bool)
    if cont and gen:
        raise RequestError(
            "'continue_final_message' and 'add_generation_prompt' cannot both be true: a continued assistant "
            "message already is where the model writes",
            param="continue_final_message",
        )
    if cont:
        last = messages[-1]
        role = last.get("role") if isinstance(last, dict) else None
        if role != "assistant":
            raise RequestError(
                f"'continue_final_message' needs the last message to be an assistant message (the text to "
                f"continue); messages[{len(messages) - 1}] has role {role!r}",
                param="continue_final_message",
            )
    call.continue_final_message = cont
    call.add_generation_prompt = (not cont) if gen is None else bool(gen)


def parse_completion(body: Any, **limits: int) -> Call:
    """A validated `/v1/completions` body: `prompt` is a string or an array of token ids."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    prompt = body.get("prompt")
    call = _common(body, "completions", **limits)
    if isinstance(prompt, str) and prompt:
        call.prompt_text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        call.prompt_ids = list(prompt)
    else:
        raise RequestError("'prompt' is required: a non-empty string or an array of token ids", param="prompt")
    lp = _get(body, "logprobs", int, 0)
    if lp not in (0, 1):
        raise RequestError("'logprobs' must be 0 or 1 (only the sampled token's log-prob)", param="logprobs")
    call.logprobs = lp == 1
    if _get(body, "echo", bool, False):
        raise RequestError("'echo' is not supported", param="echo")
    if body.get("suffix"):
        raise RequestError("'suffix' is not supported", param="suffix")
    return call
