"""A scripted policy behind the `Engine` protocol: an environment's expert, played like a model.

The warm-start (warmstart.py) and the invariant tests need episodes of a policy that already
knows the task. Rather than lay such sequences out by hand, `ScriptedEngine` answers each request
with text from a script (`reply(context_text) -> str`, e.g. `env.expert`), tokenised once: the
episode is then recorded by the same harness, with the same prompts, observation tokens, stop
rules and sample layout as a real rollout. Its "sampled" tokens carry log-prob 0.0 (the script
is deterministic) and the engine's `policy_version`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from slipstream.engine.interface import FinishReason, GenerationRequest, GenerationResult, Timings
from slipstream.engine.tokenizer import Tokenizer

Reply = Callable[[GenerationRequest, str], str]


class ScriptedEngine:
    """An engine whose completions are `reply(request, decoded prompt)`, cut at `max_tokens`."""

    def __init__(self, tokenizer: Tokenizer, reply: Reply, *, policy_version: int = 0, max_seq_len: int = 2048) -> None:
        self.tokenizer = tokenizer
        self.reply = reply
        self.max_seq_len = max_seq_len
        self._version = policy_version
        self.requests = 0

    @property
    def policy_version(self) -> int:
        return self._version

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        now = time.time()
        self.requests += 1
        text = self.reply(request, self.tokenizer.decode(request.prompt_ids))
        ids = self.tokenizer.encode(text)
        limit = min(request.params.max_tokens, self.max_seq_len - len(request.prompt_ids))
        finish: FinishReason = "stop"
        if len(ids) > limit:
            ids, finish = ids[: max(limit, 0)], "length"
        return GenerationResult(
            request_id=request.request_id,
            prompt_ids=list(request.prompt_ids),
            completion_ids=ids,
            logprobs=[0.0] * len(ids),
            segments=[(self._version, len(ids))] if ids else [],
            finish_reason=finish,
            timings=Timings(queued_at=now, started_at=now, finished_at=time.time()),
        )

    def apply_weights(self, version: int, tensors: Mapping[str, Any]) -> None:
        self._version = version

    def named_parameters(self) -> Iterator[tuple[str, Any]]:
        return iter(())

    def state_dict(self) -> Mapping[str, Any]:
        return {}

    def release(self, session_id: str) -> None:
        """Keeps no KV cache, so there is nothing to drop."""

    def stats(self) -> dict[str, float]:
        return {"requests_finished": float(self.requests)}
