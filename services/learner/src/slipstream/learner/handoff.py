"""The weight hand-off: each new version's parameters go to the weight-publisher through a directory.

The learner and its publisher share a directory (an in-memory volume in a pod, a local folder on
a laptop). `slipstream.weights.staging` writes `v<version>.safetensors` atomically; the publisher
picks staged versions up in order, stores them (manifest last) and announces them. The learner
only writes and goes on training.

Each rank of the learner's group (`group.Ranks`) stages its own part of every version into
`rank_staging_dir(staging_dir, r, ranks)` for its own weight-publisher: with one rank that is the
whole version in `staging_dir` itself; with N ranks `<staging_dir>/rank-<r>` (slipstream.weights.parts:
the partition, and how rank 0's publisher commits one manifest naming every part).

Tied parameters (an lm_head sharing the embedding) are staged once, under their first name, as
safetensors refuses aliased tensors and the engine accepts either name for a tied weight. A model
with frozen parameters (LoRA: `[model] lora_rank` > 0) stages only what trains, the adapters: the
workers hold the same frozen base from their own `[model]`, so a version is a few MB, not the model.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

from torch import nn

from slipstream.learner.group import Ranks
from slipstream.learner.version_state import DTYPES, stage_model
from slipstream.weights.staging import list_staged, rank_staging_dir


class WeightHandoff:
    """Stages the versions a group of `ranks` ranks trains, each rank's part for that rank's publisher."""

    def __init__(self, staging_dir: str | Path, *, ranks: int = 1, dtype: str = "") -> None:
        if ranks < 1:
            raise ValueError(f"a hand-off needs ranks >= 1, got {ranks}")
        if dtype and dtype not in DTYPES:
            raise ValueError(f"staged weights dtype {dtype!r} is not one of {', '.join(DTYPES)} (or empty)")
        self.staging_dir = Path(staging_dir)
        self.ranks = ranks
        self.dtype = dtype

    def stage_step(
        self,
        version: int,
        group: Ranks,
        *,
        step_finished_at: float | None = None,
        fence: Mapping[str, str] | None = None,
        trace_context: Mapping[str, str] | None = None,
    ) -> list[Path]:
        """Every rank of `group` stages its part of `version` (blocking; call it off the event loop); the files.

        `fence` (the lease holder and fencing token) goes into every part's metadata: the publisher
        announces the version only while that holder still leads the run. `trace_context` (W3C
        `traceparent`, ...: the step span's) goes there too, so the publisher's span continues the
        step's trace.
        """
        if group.world != self.ranks:
            raise ValueError(f"this hand-off stages {self.ranks} rank(s)' parts, the group has {group.world}")
        extra = {**(fence or {}), **(trace_context or {})}
        return group.stage_parts(
            version, self.staging_dir, dtype=self.dtype, step_finished_at=step_finished_at or time.time(), extra=extra
        )

    def stage(
        self,
        version: int,
        model: nn.Module,
        *,
        step_finished_at: float | None = None,
        fence: Mapping[str, str] | None = None,
        trace_context: Mapping[str, str] | None = None,
    ) -> Path:
        """Stage `version` of the whole of `model`, as a group of one rank stages it (see `stage_step`)."""
        if self.ranks != 1:
            raise ValueError(f"a whole model is one rank's part; this hand-off stages {self.ranks} ranks' parts")
        extra = {**(fence or {}), **(trace_context or {})}
        finished = step_finished_at or time.time()
        return stage_model(self.staging_dir, version, model, dtype=self.dtype, step_finished_at=finished, extra=extra)

    def highest_staged(self) -> int:
        """The newest version waiting in any rank's staging directory, or -1 when there is none."""
        found = [list_staged(rank_staging_dir(self.staging_dir, r, self.ranks)) for r in range(self.ranks)]
        return max((staged[-1].version for staged in found if staged), default=-1)
