"""Prompt groups: `n` > 1 rollouts of one prompt in one call, and groups a client names by header.

An `n` > 1 call on any route that serves it (`/v1/chat/completions`, `/v1/completions`,
`/inference/v1/generate`) is n calls of one prompt served at once: member i is recorded in session
`<session>/<i>`, so each member is its own rollout and its own episode whatever headers the
client sends; with no session named, `<session>` is fresh per call (a client known only by its
key would otherwise fold its successive groups into the same n sessions). Member i samples with
seed `seed + i` when the request fixed one, so the members are distinct draws, not one draw n
times. The n share a group key (`grp-<session>`, or the client's `x-slipstream-group`), which
the release stage publishes them under once all n are done (pending.py).

A client that sends one prompt in separate calls names the group itself: `x-slipstream-group:
<key>` (and optionally `x-slipstream-group-size: <members>`, else the endpoint's `group_size`).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from typing import Any, Protocol

from aiohttp import web

from slipstream.engine.interface import SamplingParams
from slipstream.serve.call_record import CallRecord
from slipstream.serve.protocol import Call, RequestError

GROUP_HEADER = "x-slipstream-group"
GROUP_SIZE_HEADER = "x-slipstream-group-size"
MAX_GROUP_KEY = 256
MAX_GROUP_SIZE = 4096


class Serving(Protocol):
    """What serving a group needs of the endpoint (`app.ServeApp`)."""

    def _session(self, request: web.Request, call: Call, key: str) -> str: ...
    async def _serve(
        self,
        request: web.Request,
        call: Call,
        raw: bytes,
        key: str,
        prompt_ids: list[int],
        prompt_param: str,
        user_text: str | None = None,
        *,
        session: str | None = None,
        group: tuple[str, int] | None = None,
    ) -> tuple[CallRecord, bool]: ...


def request_group(headers: Any) -> tuple[str, int]:
    """(group key, members it asks for; 0 = the endpoint's `group_size`) a client named in its
    headers, ('', 0) when none; a 400 naming the header when either is malformed."""
    key = headers.get(GROUP_HEADER, "").strip()
    size_text = headers.get(GROUP_SIZE_HEADER, "").strip()
    if not key:
        if size_text:
            raise RequestError(
                f"'{GROUP_SIZE_HEADER}' needs '{GROUP_HEADER}' (the key the members share)", param=GROUP_SIZE_HEADER
            )
        return "", 0
    if len(key) > MAX_GROUP_KEY or not key.isprintable():
        raise RequestError(
            f"'{GROUP_HEADER}' must be printable and at most {MAX_GROUP_KEY} characters, got {key[:40]!r}...",
            param=GROUP_HEADER,
        )
    if not size_text:
        return key, 0
    try:
        size = int(size_text)
    except ValueError:
        size = 0
    if not 1 <= size <= MAX_GROUP_SIZE:
        raise RequestError(
            f"'{GROUP_SIZE_HEADER}' must be an integer in [1, {MAX_GROUP_SIZE}], got {size_text!r}",
            param=GROUP_SIZE_HEADER,
        )
    return key, size


async def serve_group(
    app: Serving,
    request: web.Request,
    call: Call,
    raw: bytes,
    key: str,
    prompt_ids: list[int],
    prompt_param: str,
    n: int,
    user_text: str | None = None,
) -> tuple[list[CallRecord], bool, str]:
    """Serve `n` members of one prompt at once: (their records in member order, whether any was
    replayed from an earlier attempt, the group key)."""
    base = app._session(request, call, key)
    if not (request.headers.get("X-Session-ID", "").strip() or call.session_id):
        # No session named: every call is a fresh group of rollouts.
        base = f"{base.removeprefix('anon-')}/{uuid.uuid4().hex[:12]}"
    named = request_group(request.headers)
    group = named if named[0] else (f"grp-{base}", n)
    served = await asyncio.gather(
        *(
            app._serve(
                request,
                _member(call, f"{base}/{i}", i),
                raw + f"#{i}".encode(),
                key,
                prompt_ids,
                prompt_param,
                user_text,
                session=f"{base}/{i}",
                group=group,
            )
            for i in range(n)
        )
    )
    return [r for r, _ in served], any(rep for _, rep in served), group[0]


def _member(call: Call, session: str, index: int) -> Call:
    """Call `index` of an n-group: its own session; its own seed when the request fixed one."""
    params = call.params
    if params.seed is not None:
        fields = {f: getattr(params, f) for f in params.__struct_fields__}
        params = SamplingParams(**{**fields, "seed": params.seed + index})
    return replace(call, params=params, session_id=session, n=1)
