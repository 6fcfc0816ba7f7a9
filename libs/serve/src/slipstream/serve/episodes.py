"""Served calls of one session assembled into an `Episode`, by token-prefix matching.

A session's calls are recorded one by one, exactly as served. Assembly happens afterwards: a call
whose prompt ids start with the current sample's whole context (its prompt + completion ids)
extends that sample — the new prompt tokens past the context are an observation (mask 0, log-prob
0), the completion is sampled (mask 1, behaviour log-probs, versions). Otherwise (the client
edited history, or the chat template re-tokenised the previous assistant turn differently from
what was sampled) a new sample starts, naming the sample it branched from and the shared prefix
length, so nothing is ever rewritten or re-tokenised.

Ids are compared with ids the engine actually consumed or produced; text never enters into it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from slipstream.engine.prefill import shared_prefix
from slipstream.schemas import Episode, PolicySegment, Sample, Timings, Turn
from slipstream.schemas.packing import pack_floats, pack_ids, pack_mask
from slipstream.serve.call_record import CallRecord


@dataclass
class _Open:
    """A sample being assembled."""

    sample_id: str
    prompt_len: int
    ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    branch_of: str = ""
    branch_pos: int = 0
    finish_reason: str = ""

    def add_completion(self, call: CallRecord) -> None:
        start = len(self.ids)
        self.ids.extend(call.completion_ids)
        self.logprobs.extend(call.logprobs)
        self.mask.extend([1] * len(call.completion_ids))
        self.versions.extend(v for v, n in call.segments for _ in range(n))
        self.turns.append(Turn(role="policy", start=start, end=len(self.ids)))
        self.finish_reason = call.finish_reason

    def add_observation(self, ids: Sequence[int]) -> None:
        if not ids:
            return
        start = len(self.ids)
        # Observation tokens carry the version in force when they were appended (schema rule).
        version = self.versions[-1] if self.versions else -1
        self.ids.extend(ids)
        self.logprobs.extend([0.0] * len(ids))
        self.mask.extend([0] * len(ids))
        self.versions.extend([version] * len(ids))
        self.turns.append(Turn(role="observation", start=start, end=len(self.ids)))

    def sample(self) -> Sample:
        return Sample(
            sample_id=self.sample_id,
            prompt_len=self.prompt_len,
            token_ids=pack_ids(self.ids),
            logprobs=pack_floats(self.logprobs),
            loss_mask=pack_mask(self.mask),
            segments=_segments(self.versions),
            turns=list(self.turns),
            branch_of=self.branch_of,
            branch_pos=self.branch_pos,
            finish_reason=self.finish_reason,
        )


def _segments(versions: Sequence[int]) -> list[PolicySegment]:
    out: list[PolicySegment] = []
    for v in versions:
        if out and out[-1].policy_version == v:
            out[-1].n_tokens += 1
        else:
            out.append(PolicySegment(policy_version=v, n_tokens=1))
    return out


def assemble(
    episode_id: str, calls: Sequence[CallRecord], *, env: str, run_id: str = "", worker_id: str = ""
) -> Episode:
    """One episode from a session's calls, in the order they were served."""
    if not calls:
        raise ValueError(f"episode {episode_id!r}: no calls to assemble")
    samples: list[_Open] = []
    for call in calls:
        cur = samples[-1] if samples else None
        if cur is not None and call.prompt_ids[: len(cur.ids)] == cur.ids:
            cur.add_observation(call.prompt_ids[len(cur.ids) :])
        else:
            sid = episode_id if not samples else f"{episode_id}/s{len(samples)}"
            branch_pos = shared_prefix(cur.ids, call.prompt_ids) if cur is not None else 0
            cur = _Open(
                sample_id=sid,
                prompt_len=len(call.prompt_ids),
                ids=list(call.prompt_ids),
                branch_of=cur.sample_id if cur is not None else "",
                branch_pos=branch_pos,
            )
            samples.append(cur)
        cur.add_completion(call)
    first, last = calls[0], calls[-1]
    return Episode(
        episode_id=episode_id,
        task_id=episode_id,
        env=env,
        run_id=run_id,
        group_id=episode_id,
        samples=[s.sample() for s in samples],
        final_text=last.text,
        finish_reason=last.finish_reason,
        worker_id=worker_id,
        timings=Timings(started_at=first.created, finished_at=last.finished_at),
        metadata={
            "session_id": first.session_id,
            "model": last.model,
            "template_hash": last.template_hash,
            "calls": ",".join(c.call_id for c in calls),
            # The request the final answer replies to: what a rubric judge is shown as the task
            # (slipstream.judge reads `metadata["prompt"]`; episodes otherwise carry token ids only).
            "prompt": last.task_text,
            **_group_tags(calls),
        },
        counts={"turns": len(calls), "samples": len(samples), "calls": len(calls)},
    )


def _group_tags(calls: Sequence[CallRecord]) -> dict[str, str]:
    """The session's prompt group (its first call that names one), for the pending stage."""
    for call in calls:
        if call.group_key:
            return {"group_key": call.group_key, "group_size": str(call.group_size)}
    return {}
