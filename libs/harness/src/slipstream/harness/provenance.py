"""Token provenance: proof that an episode's ids were made once, by the engine and the tokenizer.

`RecordingEngine` wraps any engine and keeps every call that went through it (prompt ids,
completion ids, log-probs). `token_problems` then checks an episode against those calls:

- every engine call extended one sample of the episode, and that sample's ids start with the
  call's prompt + completion exactly (so no sample was rebuilt from text, and no earlier prefix
  was rewritten after the call);
- loss mask 1 marks exactly the positions the engine sampled, with the engine's log-probs, and
  nothing else (observation and prompt tokens are never trained);
- every other token after the prompt lies in an observation turn whose ids are the tokenizer's
  encoding of that turn's text;
- a branched sample shares exactly `branch_pos` leading ids with the sample it names, which
  precedes it; per-token arrays and version segments have the sample's length.

It returns a list of readable problems (empty when the episode is sound); tests assert it is
empty for every registered environment.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from slipstream.engine.interface import Engine, GenerationRequest, GenerationResult
from slipstream.engine.tokenizer import Tokenizer
from slipstream.harness.episode import sample_of_request
from slipstream.schemas import Episode


@dataclass(frozen=True)
class EngineCall:
    """One finished engine call as the engine saw it."""

    request_id: str
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


class RecordingEngine:
    """An `Engine` that forwards to `inner` and records every call (for provenance checks)."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.calls: list[EngineCall] = []

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    @property
    def max_seq_len(self) -> int | None:
        value = getattr(self.inner, "max_seq_len", None)
        return value if isinstance(value, int) else None

    async def start(self) -> None:
        await self.inner.start()

    async def stop(self) -> None:
        await self.inner.stop()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        result = await self.inner.generate(request)
        self.calls.append(
            EngineCall(
                request_id=request.request_id,
                prompt_ids=tuple(request.prompt_ids),
                completion_ids=tuple(result.completion_ids),
                logprobs=tuple(result.logprobs),
            )
        )
        return result

    def apply_weights(self, version: int, tensors: Mapping[str, Any]) -> None:
        self.inner.apply_weights(version, tensors)

    def named_parameters(self) -> Iterator[tuple[str, Any]]:
        return self.inner.named_parameters()

    def state_dict(self) -> Mapping[str, Any]:
        return self.inner.state_dict()

    def release(self, session_id: str) -> None:
        release = getattr(self.inner, "release", None)
        if release is not None:
            release(session_id)

    def stats(self) -> dict[str, float]:
        return self.inner.stats()

    def calls_of(self, episode: Episode) -> list[EngineCall]:
        """The recorded calls that belong to `episode`'s samples."""
        ids = {s.sample_id for s in episode.samples}
        return [c for c in self.calls if sample_of_request(c.request_id) in ids]


def token_problems(episode: Episode, calls: list[EngineCall], tokenizer: Tokenizer) -> list[str]:
    """Every way `episode` departs from the engine calls that made it (see the module docstring)."""
    problems: list[str] = []
    by_id = {s.sample_id: s for s in episode.samples}
    order = {s.sample_id: i for i, s in enumerate(episode.samples)}
    sampled: dict[str, dict[int, float]] = {sid: {} for sid in by_id}
    for call in calls:
        sid = sample_of_request(call.request_id)
        sample = by_id.get(sid)
        if sample is None:
            problems.append(f"engine call {call.request_id!r} extended no sample of episode {episode.episode_id!r}")
            continue
        ids = sample.ids()
        made = [*call.prompt_ids, *call.completion_ids]
        if ids[: len(made)] != made:
            at = next((i for i, (a, b) in enumerate(zip(ids, made, strict=False)) if a != b), min(len(ids), len(made)))
            problems.append(
                f"sample {sid!r}: ids differ from engine call {call.request_id!r}'s prompt + completion at "
                f"position {at} (sample has {len(ids)} ids, the call made {len(made)})"
            )
            continue
        start = len(call.prompt_ids)
        for k, lp in enumerate(call.logprobs):
            sampled[sid][start + k] = lp
    for sample in episode.samples:
        sid = sample.sample_id
        ids = sample.ids()
        n_after = sample.completion_len()
        mask, logprobs = sample.mask(), sample.behaviour_logprobs()
        if n_after < 0 or len(mask) != n_after or len(logprobs) != n_after:
            problems.append(
                f"sample {sid!r}: {n_after} ids after the prompt but {len(mask)} mask "
                f"and {len(logprobs)} log-prob entries"
            )
            continue
        if sum(seg.n_tokens for seg in sample.segments) != n_after:
            problems.append(
                f"sample {sid!r}: version segments cover {sum(s.n_tokens for s in sample.segments)} of {n_after} tokens"
            )
        engine_positions = sampled[sid]
        masked = {sample.prompt_len + k for k, m in enumerate(mask) if m}
        if masked != set(engine_positions):
            extra = sorted(masked - set(engine_positions))[:5]
            missing = sorted(set(engine_positions) - masked)[:5]
            problems.append(
                f"sample {sid!r}: loss mask marks positions the engine did not sample {extra} "
                f"or misses sampled positions {missing}"
            )
        for pos, lp in engine_positions.items():
            k = pos - sample.prompt_len
            if 0 <= k < n_after and logprobs[k] != _as_float32(lp):
                problems.append(f"sample {sid!r}: behaviour log-prob at {pos} is {logprobs[k]}, the engine gave {lp}")
                break
        covered = set(engine_positions)
        for turn in sample.turns:
            if turn.role == "policy":
                continue
            expect = tokenizer.encode(turn.text)
            if ids[turn.start : turn.end] != expect:
                problems.append(
                    f"sample {sid!r}: {turn.role} turn [{turn.start}, {turn.end}) is not the tokenizer's encoding "
                    f"of its text {turn.text[:40]!r}"
                )
            covered.update(range(turn.start, turn.end))
        stray = sorted(set(range(sample.prompt_len, len(ids))) - covered)
        if stray:
            problems.append(
                f"sample {sid!r}: tokens {stray[:5]} after the prompt came from neither the engine nor an observation"
            )
        if sample.branch_of:
            parent = by_id.get(sample.branch_of)
            if parent is None or order[sample.branch_of] >= order[sid]:
                problems.append(f"sample {sid!r} branches from {sample.branch_of!r}, which is not an earlier sample")
                continue
            pids = parent.ids()
            shared = 0
            while shared < min(len(ids), len(pids)) and ids[shared] == pids[shared]:
                shared += 1
            if shared != sample.branch_pos:
                problems.append(
                    f"sample {sid!r}: shares {shared} leading ids with {sample.branch_of!r}, "
                    f"branch_pos says {sample.branch_pos}"
                )
            if not sample.edit:
                problems.append(f"sample {sid!r} branches from {sample.branch_of!r} but names no edit")
    return problems


def _as_float32(x: float) -> float:
    # Log-probs travel as float32; the engine's are Python floats.
    return float(struct.unpack("<f", struct.pack("<f", x))[0])
