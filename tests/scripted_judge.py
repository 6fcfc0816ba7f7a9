"""A scripted judge: a tiny OpenAI-compatible `/v1/chat/completions` server on a loopback port.

It stands in for an external judge model (a vLLM or SGLang server, a hosted API): each test
scripts what it answers per call (`Reply`: a verdict text, a delay past the client's timeout,
an HTTP status such as 429 with Retry-After), keyed by the rubric it is asked about and how many
times that rubric was already asked about the same response. The judge under test talks to it
through the real `openai` client over a real socket; the server records every call (messages,
model, when it arrived, how many were in flight) so tests can assert what was asked and when.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

_RUBRIC = re.compile(r"<rubric>\n(.*?)\n</rubric>", re.DOTALL)
_RESPONSE = re.compile(r"<response>\n(.*?)\n</response>", re.DOTALL)


@dataclass(frozen=True)
class Reply:
    """What the server does for one call: answer `text` after `delay_s`, or fail with `status`."""

    text: str = ""
    status: int = 200
    delay_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)


def score(n: float, reasoning: str = "Checked the response against the rubric.") -> Reply:
    return Reply(text=f"{reasoning}\nSCORE: {n:g}")


def too_many(retry_after: str = "") -> Reply:
    return Reply(status=429, headers={"Retry-After": retry_after} if retry_after else {})


@dataclass(frozen=True)
class Call:
    """One request the server received."""

    index: int
    """Order of arrival over all calls (0-based)."""
    rubric: str
    response: str
    attempt: int
    """Calls about the same (rubric, response) before this one: 0 first, 1 on the first re-ask or retry."""
    messages: list[dict[str, Any]]
    model: str
    arrived: float
    in_flight: int
    """Calls being handled when this one arrived, itself included."""
    body: dict[str, Any] = field(default_factory=dict)
    """The whole request body (sampling settings, extras such as `continue_final_message`)."""


Script = Callable[[Call], Reply]


class ScriptedJudge:
    """Start with `await judge.start()`; `judge.url` is the base URL (.../v1) for the client."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.calls: list[Call] = []
        self._in_flight = 0
        self.max_in_flight = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> ScriptedJudge:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        # A scripted slow answer the client gave up on must not hold the test's teardown.
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.2)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}/v1"
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def calls_about(self, rubric: str) -> list[Call]:
        return [c for c in self.calls if c.rubric == rubric]

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        messages = body["messages"]
        user = next(m["content"] for m in messages if m["role"] == "user")
        rubric_m, response_m = _RUBRIC.search(user), _RESPONSE.search(user)
        rubric = rubric_m.group(1) if rubric_m else ""
        response = response_m.group(1) if response_m else ""
        attempt = sum(1 for c in self.calls if c.rubric == rubric and c.response == response)
        self._in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self._in_flight)
        call = Call(
            index=len(self.calls),
            rubric=rubric,
            response=response,
            attempt=attempt,
            messages=messages,
            model=body.get("model", ""),
            arrived=time.monotonic(),
            in_flight=self._in_flight,
            body=body,
        )
        self.calls.append(call)
        try:
            reply = self.script(call)
            if reply.delay_s:
                await asyncio.sleep(reply.delay_s)
            if reply.status != 200:
                error = {"error": {"message": f"scripted {reply.status}", "type": "scripted", "code": reply.status}}
                return web.json_response(error, status=reply.status, headers=reply.headers)
            return web.json_response(
                {
                    "id": f"chatcmpl-{call.index}",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": call.model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": reply.text},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
                }
            )
        finally:
            self._in_flight -= 1
