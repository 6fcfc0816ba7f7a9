"""Response bodies in OpenAI's shapes, from a recorded call: JSON objects and SSE chunk streams.

Everything here is a pure function of the `CallRecord` (plus the request's options), so a
replayed retry answers byte for byte what the first attempt would have. Extras the `openai`
client tolerates ride along: `slipstream` (call id, session, per-token policy segments, template
hash) always, and vLLM's `prompt_token_ids` / `choices[].token_ids` on `return_token_ids`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from slipstream.serve.call_record import CallRecord
from slipstream.serve.chat import ChatFormat, Reply
from slipstream.serve.protocol import Call
from slipstream.serve.top_logprobs import Alternatives


def _usage(records: list[CallRecord]) -> dict[str, int]:
    """One call's usage: the prompt once, the completions of all its choices."""
    p, c = len(records[0].prompt_ids), sum(len(r.completion_ids) for r in records)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _extras(record: CallRecord) -> dict[str, Any]:
    return {
        "call_id": record.call_id,
        "session_id": record.session_id,
        "policy_segments": [list(s) for s in record.segments],
        "template_hash": record.template_hash,
    }


def _group_extras(records: list[CallRecord]) -> dict[str, Any]:
    """The body's `slipstream`: choice 0's extras, and with n > 1 every member's call and session."""
    out = _extras(records[0])
    if len(records) > 1:
        out["call_ids"] = [r.call_id for r in records]
        out["session_ids"] = [r.session_id for r in records]
        out["group_key"] = records[0].group_key
    return out


def completion_text(record: CallRecord, fmt: ChatFormat) -> str:
    """The completion's text with the stop string that ended it cut off (OpenAI leaves it out)."""
    text = record.text
    if record.finish_reason != "stop":
        return text
    cuts = [i for s in record.params.stop if (i := text.find(s)) >= 0]
    return text[: min(cuts)] if cuts else text


def _token_logprobs(
    record: CallRecord, fmt: ChatFormat, lo: int = 0, hi: int | None = None, tops: Alternatives | None = None
) -> list[dict[str, Any]]:
    out = []
    for k, (tid, lp) in enumerate(zip(record.completion_ids[lo:hi], record.logprobs[lo:hi], strict=True), start=lo):
        out.append(
            {
                **_token_entry(fmt, tid, lp),
                "top_logprobs": [_token_entry(fmt, t, v) for t, v in tops[k]] if tops else [],
            }
        )
    return out


def _token_entry(fmt: ChatFormat, tid: int, logprob: float) -> dict[str, Any]:
    token = fmt.tokenizer.decode([tid])
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def _message(reply: Reply) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": reply.content or None, "refusal": None}
    if reply.tool_calls:
        msg["tool_calls"] = reply.tool_calls
    elif msg["content"] is None:
        msg["content"] = ""
    return msg


def render_chat(
    model: str,
    records: list[CallRecord],
    replies: list[Reply],
    call: Call,
    fmt: ChatFormat,
    tops: list[Alternatives | None] | None = None,
) -> dict[str, Any]:
    """A chat completion of one call's records, one choice each (n > 1: in member order); each
    choice carries its own record's `slipstream` extras."""
    tops = tops or [None] * len(records)
    choices = []
    for i, (record, reply, top) in enumerate(zip(records, replies, tops, strict=True)):
        choice: dict[str, Any] = {
            "index": i,
            "message": _message(reply),
            "finish_reason": reply.finish_reason,
            "logprobs": {"content": _token_logprobs(record, fmt, tops=top), "refusal": None} if call.logprobs else None,
            "slipstream": _extras(record),
        }
        if call.return_token_ids:
            choice["token_ids"] = record.completion_ids
        choices.append(choice)
    first = records[0]
    out: dict[str, Any] = {
        "id": f"chatcmpl-{first.call_id}",
        "object": "chat.completion",
        "created": int(first.created),
        "model": model,
        "choices": choices,
        "usage": _usage(records),
        "slipstream": _group_extras(records),
    }
    if call.return_token_ids:
        out["prompt_token_ids"] = first.prompt_ids
    return out


def render_completion(model: str, records: list[CallRecord], call: Call, fmt: ChatFormat) -> dict[str, Any]:
    """A text completion of one call's records, one choice each (n > 1: in member order)."""
    choices = []
    for i, record in enumerate(records):
        choice: dict[str, Any] = {
            "index": i,
            "text": completion_text(record, fmt),
            "finish_reason": record.finish_reason,
            "logprobs": _legacy_logprobs(record, fmt) if call.logprobs else None,
            "slipstream": _extras(record),
        }
        if call.return_token_ids:
            choice["token_ids"] = record.completion_ids
        choices.append(choice)
    first = records[0]
    out: dict[str, Any] = {
        "id": f"cmpl-{first.call_id}",
        "object": "text_completion",
        "created": int(first.created),
        "model": model,
        "choices": choices,
        "usage": _usage(records),
        "slipstream": _group_extras(records),
    }
    if call.return_token_ids:
        out["prompt_token_ids"] = first.prompt_ids
    return out


def _legacy_logprobs(record: CallRecord, fmt: ChatFormat) -> dict[str, Any]:
    tokens = [fmt.tokenizer.decode([t]) for t in record.completion_ids]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": list(record.logprobs), "top_logprobs": None, "text_offset": offsets}


def text_deltas(record: CallRecord, fmt: ChatFormat, final: str) -> Iterator[tuple[int, str]]:
    """(token index, new text) per completion token, summing to `final` (the cut completion text).

    A token that ends inside a multi-byte character adds nothing until the character is whole;
    text past `final` (the stop string) is never sent.
    """
    sent = 0
    ids = record.completion_ids
    for k in range(len(ids)):
        prefix = fmt.tokenizer.decode(ids[: k + 1]).rstrip("\ufffd")
        upto = min(len(prefix), len(final))
        yield k, final[sent:upto] if upto > sent else ""
        sent = max(sent, upto)
    if sent < len(final):  # decoding per prefix can lag the whole (never observed; kept exact anyway)
        yield len(ids) - 1, final[sent:]


async def _open_sse(request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
    resp = web.StreamResponse(
        status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
    )
    await resp.prepare(request)
    return resp


async def _send(resp: web.StreamResponse, obj: dict[str, Any] | str) -> None:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    await resp.write(f"data: {data}\n\n".encode())


async def sse_chat(
    request: web.Request,
    model: str,
    records: list[CallRecord],
    replies: list[Reply],
    call: Call,
    fmt: ChatFormat,
    headers: dict[str, str],
    tops: list[Alternatives | None] | None = None,
) -> web.StreamResponse:
    """The replayed stream of one call's records: each choice's chunks in turn (n > 1: member
    order, each chunk naming its choice's `index`), its last chunk with its record's extras."""
    resp = await _open_sse(request, headers)
    first = records[0]
    base = {"id": f"chatcmpl-{first.call_id}", "object": "chat.completion.chunk", "created": int(first.created)}
    base["model"] = model
    tops = tops or [None] * len(records)
    for index, (record, reply, top) in enumerate(zip(records, replies, tops, strict=True)):
        await _sse_chat_choice(resp, base, index, record, reply, call, fmt, top)
    if call.include_usage:
        await _send(resp, {**base, "choices": [], "usage": _usage(records)})
    await _send(resp, "[DONE]")
    await resp.write_eof()
    return resp


async def _sse_chat_choice(
    resp: web.StreamResponse,
    base: dict[str, Any],
    index: int,
    record: CallRecord,
    reply: Reply,
    call: Call,
    fmt: ChatFormat,
    tops: Alternatives | None,
) -> None:
    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        return {**base, "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}

    first: dict[str, Any] = chunk({"role": "assistant", "content": ""})
    if call.return_token_ids and index == 0:
        first["prompt_token_ids"] = record.prompt_ids
    await _send(resp, first)
    if reply.tool_calls:
        if reply.content:
            await _send(resp, chunk({"content": reply.content}))
        for i, tc in enumerate(reply.tool_calls):
            await _send(resp, chunk({"tool_calls": [{"index": i, **tc}]}))
        if call.logprobs:
            await _send(resp, chunk({}, logprobs={"content": _token_logprobs(record, fmt, tops=tops), "refusal": None}))
    else:
        last_k = -1
        for k, text in text_deltas(record, fmt, reply.content):
            fresh = k > last_k  # the trailing catch-up delta repeats the last index: its token went already
            last_k = k
            lp = (
                {"content": _token_logprobs(record, fmt, k, k + 1, tops), "refusal": None}
                if call.logprobs and fresh
                else None
            )
            ids = [record.completion_ids[k]] if call.return_token_ids and fresh else None
            if text or lp is not None or ids is not None:  # a token's id travels even when it adds no text
                ch = chunk({"content": text}, logprobs=lp)
                if ids is not None:
                    ch["choices"][0]["token_ids"] = ids
                await _send(resp, ch)
    last = chunk({}, finish=reply.finish_reason)
    last["slipstream"] = _extras(record)
    await _send(resp, last)


async def sse_completion(
    request: web.Request, model: str, records: list[CallRecord], call: Call, fmt: ChatFormat, headers: dict[str, str]
) -> web.StreamResponse:
    """The replayed stream of one call's records, each choice's chunks in turn (`index` names it)."""
    resp = await _open_sse(request, headers)
    first = records[0]
    base = {"id": f"cmpl-{first.call_id}", "object": "text_completion", "created": int(first.created), "model": model}
    for index, record in enumerate(records):

        def chunk(text: str, finish: str | None = None, index: int = index) -> dict[str, Any]:
            return {**base, "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": None}]}

        for _, text in text_deltas(record, fmt, completion_text(record, fmt)):
            if text:
                await _send(resp, chunk(text))
        last = chunk("", finish=record.finish_reason)
        last["slipstream"] = _extras(record)
        await _send(resp, last)
    if call.include_usage:
        await _send(resp, {**base, "choices": [], "usage": _usage(records)})
    await _send(resp, "[DONE]")
    await resp.write_eof()
    return resp
