"""Chat streams written while the engine generates: each token's text goes out as it is sampled.

Used for `stream: true` chat calls without tools or `top_logprobs` on an engine that can show a running request's
tokens (`TorchEngine.progress`); any other stream is replayed from the finished call
(`render.sse_chat`). The call is served and recorded exactly as a non-streamed one (`ServeApp._serve`
runs as a task under a call id chosen here); this module only watches the engine's snapshot of the
request every `POLL_S` and writes the text that cannot change any more:

- decoded from the ids so far, less a trailing incomplete UTF-8 character;
- cut at the first stop string, and less any tail that could still grow into one (`<|im_` is
  held back until the next token shows whether it becomes `<|im_end|>`);

so the deltas add up to exactly what the replayed stream and the non-streamed body say. A
token's log-prob and id travel in its own chunk (`logprobs`, `return_token_ids`), as in the replay.
Nothing is sent until the first token is sampled: a call the engine refuses (a prompt past
`max_seq_len`, say) still answers with its HTTP error. The response's headers are written
before the call finishes, so they carry the call id and the policy version at its start; the
final chunk's `slipstream` extras carry the session and every token's version, as always.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from slipstream.serve.call_record import CallRecord
from slipstream.serve.chat import ChatFormat, Reply
from slipstream.serve.protocol import Call
from slipstream.serve.render import _extras, _open_sse, _send, _token_entry, _usage

POLL_S = 0.01


def settled_text(text: str, stops: list[str]) -> str:
    """The part of a growing completion's text that later tokens cannot change or hide."""
    text = text.rstrip("\ufffd")
    cuts = [i for s in stops if (i := text.find(s)) >= 0]
    if cuts:
        return text[: min(cuts)]
    held = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                held = max(held, n)
                break
    return text[: len(text) - held]


async def stream_chat(
    request: web.Request,
    *,
    progress: Callable[[str], tuple[list[int], list[float]] | None],
    serve: Callable[[str], Awaitable[tuple[CallRecord, bool]]],
    finish: Callable[[CallRecord], Reply],
    replay: Callable[[CallRecord, bool], Awaitable[web.StreamResponse]],
    call: Call,
    fmt: ChatFormat,
    model: str,
    version: int,
) -> web.StreamResponse:
    """Serve `call` live: `serve(call_id)` runs it, `finish(record)` makes its reply, and `replay`
    answers a call that was over (or replayed from the ledger) before its first token was seen."""
    call_id = uuid.uuid4().hex
    task = asyncio.ensure_future(serve(call_id))
    seen: tuple[list[int], list[float]] | None = None
    while not task.done():
        await asyncio.wait({task}, timeout=POLL_S)
        seen = progress(call_id)
        if seen is not None and seen[0]:
            break
    if seen is None or not seen[0] or (task.done() and task.exception() is not None):
        record, replayed = await task  # an error raises here, before any byte went out
        return await replay(record, replayed)

    created = int(time.time())
    headers = {"x-slipstream-call-id": call_id, "x-slipstream-policy-version": str(version)}
    resp = await _open_sse(request, headers)
    base = {"id": f"chatcmpl-{call_id}", "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]}

    sent_tokens, sent_text = 0, ""

    async def send_tokens(ids: list[int], logprobs: list[float], upto: str | None) -> None:
        """Chunks for tokens not sent yet; `upto` (the final reply's text) caps the text at the end."""
        nonlocal sent_tokens, sent_text
        for k in range(sent_tokens, len(ids)):
            text = settled_text(fmt.tokenizer.decode(ids[: k + 1]), call.params.stop)
            if upto is not None:
                text = text[: len(upto)]
            delta = text[len(sent_text) :] if len(text) > len(sent_text) else ""
            lp = None
            if call.logprobs:
                entry = {**_token_entry(fmt, ids[k], logprobs[k]), "top_logprobs": []}
                lp = {"content": [entry], "refusal": None}
            if delta or lp is not None or call.return_token_ids:
                ch = chunk({"content": delta}, logprobs=lp)
                if call.return_token_ids:
                    ch["choices"][0]["token_ids"] = [ids[k]]
                await _send(resp, ch)
            sent_text += delta
            sent_tokens = k + 1

    await _send(resp, chunk({"role": "assistant", "content": ""}))
    try:
        while True:
            seen = progress(call_id)
            if seen is not None:
                await send_tokens(*seen, upto=None)
            if task.done():
                break
            await asyncio.wait({task}, timeout=POLL_S)
        record, _ = await task
    except Exception:
        task.cancel()
        raise
    reply = finish(record)
    await send_tokens(record.completion_ids, record.logprobs, upto=reply.content)
    if sent_text != reply.content and reply.content.startswith(sent_text):
        await _send(resp, chunk({"content": reply.content[len(sent_text) :]}))
    last = chunk({}, finish_reason=reply.finish_reason)
    last["slipstream"] = _extras(record)
    await _send(resp, last)
    if call.include_usage:
        await _send(resp, {**base, "choices": [], "usage": _usage([record])})
    await _send(resp, "[DONE]")
    await resp.write_eof()
    return resp
