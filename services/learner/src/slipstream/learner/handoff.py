"""The weight hand-off: each new version's parameters go to the weight-publisher through a directory.

The learner and its publisher share a directory (an in-memory volume in a pod, a local folder on
a laptop). `slipstream.weights.staging` writes `v<version>.safetensors` atomically; the publisher
picks staged versions up in order, stores them (manifest last) and announces them. The learner
only writes and goes on training.

Tied parameters (an lm_head sharing the embedding) are staged once, under their first name, as
safetensors refuses aliased tensors and the engine accepts either name for a tied weight. A model
with frozen parameters (LoRA: `[model] lora_rank` > 0) stages only what trains, the adapters: the
workers hold the same frozen base from their own `[model]`, so a version is a few MB, not the model.

With `[learner] ranks` > 1 (`RankHandoff`), each rank actor stages its own part of every version
into `<staging_dir>/rank-<r>` for its own weight-publisher (slipstream.weights.parts: the
partition, and how rank 0's publisher commits one manifest naming every part).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from slipstream.learner.version_state import DTYPES, unique_state
from slipstream.weights.staging import list_staged, rank_staging_dir, stage

if TYPE_CHECKING:
    from slipstream.learner.ranks import RankGroup
    from slipstream.learner.trainer import Trainer


class WeightHandoff:
    """Stages versions of one model for the weight-publisher."""

    def __init__(self, staging_dir: str | Path, *, dtype: str = "") -> None:
        if dtype and dtype not in DTYPES:
            raise ValueError(f"staged weights dtype {dtype!r} is not one of {', '.join(DTYPES)} (or empty)")
        self.staging_dir = Path(staging_dir)
        self.dtype = DTYPES.get(dtype)

    def stage(
        self,
        version: int,
        model: nn.Module,
        *,
        step_finished_at: float | None = None,
        fence: Mapping[str, str] | None = None,
        trace_context: Mapping[str, str] | None = None,
    ) -> Path:
        """Write `version` of `model`'s weights (blocking; call it off the event loop).

        `fence` (the lease holder and fencing token) goes into the file's metadata: the
        publisher announces the version only while that holder still leads the run.
        `trace_context` (W3C `traceparent`, ...: the step span's) goes there too, so the
        publisher's span continues the step's trace.
        """
        tensors = unique_state(model)
        if self.dtype is not None:
            tensors = {k: v.detach().to(self.dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        extra = {**(fence or {}), **(trace_context or {})}
        return stage(self.staging_dir, version, tensors, step_finished_at=step_finished_at or time.time(), extra=extra)

    def stage_step(
        self,
        version: int,
        trainer: Trainer | RankGroup,
        *,
        step_finished_at: float | None = None,
        fence: Mapping[str, str] | None = None,
        trace_context: Mapping[str, str] | None = None,
    ) -> list[Path]:
        """Stage `version` of what `trainer` trains (see `stage`); the staged files."""
        path = self.stage(
            version, trainer.model, step_finished_at=step_finished_at, fence=fence, trace_context=trace_context
        )
        return [path]

    def highest_staged(self) -> int:
        """The newest version waiting in the staging directory, or -1 when there is none."""
        staged = list_staged(self.staging_dir)
        return staged[-1].version if staged else -1


class RankHandoff:
    """Stages versions of a model trained by N rank actors: each rank writes its own part for its own publisher."""

    def __init__(self, staging_dir: str | Path, ranks: int, *, dtype: str = "") -> None:
        if ranks < 2:
            raise ValueError(f"a RankHandoff needs ranks >= 2, got {ranks} (one rank stages with WeightHandoff)")
        if dtype and dtype not in DTYPES:
            raise ValueError(f"staged weights dtype {dtype!r} is not one of {', '.join(DTYPES)} (or empty)")
        self.staging_dir = Path(staging_dir)
        self.ranks = ranks
        self.dtype = dtype

    def stage_step(
        self,
        version: int,
        trainer: Trainer | RankGroup,
        *,
        step_finished_at: float | None = None,
        fence: Mapping[str, str] | None = None,
        trace_context: Mapping[str, str] | None = None,
    ) -> list[Path]:
        """Every rank stages its part of `version` (blocking; call it off the event loop); the staged files.

        `fence` and `trace_context` go into every part's metadata, as `WeightHandoff.stage` does."""
        if not hasattr(trainer, "stage_parts"):
            raise TypeError(f"ranks = {self.ranks} stages through a RankGroup, got {type(trainer).__name__}")
        extra = {**(fence or {}), **(trace_context or {})}
        return trainer.stage_parts(
            version, self.staging_dir, dtype=self.dtype, step_finished_at=step_finished_at or time.time(), extra=extra
        )

    def highest_staged(self) -> int:
        """The newest version waiting in any rank's staging directory, or -1 when there is none."""
        found = [list_staged(rank_staging_dir(self.staging_dir, r, self.ranks)) for r in range(self.ranks)]
        return max((staged[-1].version for staged in found if staged), default=-1)
