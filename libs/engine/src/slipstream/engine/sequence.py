"""One request's life inside the engine: its tokens, cache slot, RNG stream, versions and stop rules.

The engine's scheduler moves these between the waiting queue and the slot pool; everything that
is about a single request (what was sampled, under which policy version, whether it must stop)
lives here, so the scheduler stays about batching.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from slipstream.engine.interface import FinishReason, GenerationRequest, GenerationResult, Timings
from slipstream.engine.tokenizer import Tokenizer

# Extra tokens decoded in front of a stop string's length when checking the tail: a token can
# decode to nothing on its own (a partial UTF-8 sequence), so a few more keep the match whole.
_STOP_TAIL_SLACK = 8


@dataclass
class SequenceState:
    """A request being generated (or waiting to be)."""

    request: GenerationRequest
    generator: torch.Generator
    queued_at: float = field(default_factory=time.time)
    started_at: float = 0.0
    finished_at: float = 0.0
    slot: int = -1
    # Tokens whose keys/values are in the cache slot; tokens[cache_len:] still need a forward.
    cache_len: int = 0
    # Leading tokens whose keys/values were copied from another slot (a shared prompt prefix).
    shared_prefix: int = 0
    tokens: list[int] = field(default_factory=list)
    completion: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    segments: list[list[int]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    # MoE models: the routes of the cached tokens, read from the cache when the request retires.
    routes: bytes = b""
    routes_per_token: int = 0
    # Speculative decoding: the main model's hidden state at the position whose distribution gave
    # tokens[-1] (what the MTP modules draft the next tokens from); None until a forward made it.
    draft_hidden: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.tokens = list(self.request.prompt_ids)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, logprob: float, policy_version: int) -> None:
        """Record a sampled token and the version that produced it (run-length)."""
        self.tokens.append(token)
        self.completion.append(token)
        self.logprobs.append(logprob)
        if self.segments and self.segments[-1][0] == policy_version:
            self.segments[-1][1] += 1
        else:
            self.segments.append([policy_version, 1])

    def check_stop(self, tokenizer: Tokenizer, max_seq_len: int) -> None:
        """Set finish_reason if the last sampled token ends the request."""
        params = self.request.params
        last = self.completion[-1]
        hit_eos = not params.ignore_eos and last == tokenizer.eos_id
        if hit_eos or last in params.stop_token_ids or (params.stop and self._tail_has_stop_string(tokenizer)):
            self.finish_reason = "stop"
        elif len(self.completion) >= params.max_tokens or len(self.tokens) >= max_seq_len:
            self.finish_reason = "length"

    def _tail_has_stop_string(self, tokenizer: Tokenizer) -> bool:
        # Only the tail can hold a new match: an earlier one would already have stopped us.
        stops = self.request.params.stop
        window = max(len(s) for s in stops) + _STOP_TAIL_SLACK
        tail = tokenizer.decode(self.completion[-window:])
        return any(s in tail for s in stops)

    def finish(self, reason: FinishReason) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
        self.finished_at = time.time()

    def result(self) -> GenerationResult:
        assert self.finish_reason is not None, "result() of an unfinished sequence"
        return GenerationResult(
            request_id=self.request_id,
            prompt_ids=list(self.request.prompt_ids),
            completion_ids=list(self.completion),
            logprobs=list(self.logprobs),
            segments=[(v, n) for v, n in self.segments],
            finish_reason=self.finish_reason,
            timings=Timings(
                queued_at=self.queued_at,
                started_at=self.started_at,
                finished_at=self.finished_at,
                generate_s=max(0.0, self.finished_at - self.queued_at),
            ),
            routes=self.routes,
            routes_per_token=self.routes_per_token,
        )
