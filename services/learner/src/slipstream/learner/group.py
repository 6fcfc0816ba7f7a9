"""The learner's training ranks, driven as one: the `Ranks` interface, its group of one, and `open_ranks`.

The service, the hand-off, the committer and the resume logic see one thing whatever `[learner]
ranks` says: a group of ranks that steps, stages each version (every rank its part), writes and
restores checkpoints, and closes. Two implementations, chosen once, by `open_ranks`:

    ranks = 1   `SingleRank`: the group of one runs in this process, a plain `Trainer` over the
                unsharded policy (no Ray, no process group, no extra process); its step is
                `Trainer.step` itself, so results and speed are those of the single-process learner.
    ranks = N   `RankGroup` (ranks.py): N FSDP2 rank actors on Ray, this process their driver.

A group of one stages its one part, the whole version, straight into the staging directory
(`rank_staging_dir` of rank 0 of 1), and writes whole-file checkpoints (model.safetensors +
optimizer.pt); the Ray group's ranks stage into `<staging_dir>/rank-<r>` and checkpoint through
torch.distributed.checkpoint. Either reads the other's checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from slipstream.engine.source import ModelSource, load_model
from slipstream.learner.checkpoint import Checkpoint, restore
from slipstream.learner.config import LearnerSection
from slipstream.learner.ranks import RankGroup
from slipstream.learner.trainer import StepStats, Trainer
from slipstream.learner.version_state import stage_model
from slipstream.rl import LossConfig
from slipstream.schemas import ScoredEpisode
from slipstream.telemetry.logs import get_logger
from slipstream.weights.staging import rank_staging_dir

log = get_logger(__name__)


class Ranks(Protocol):
    """The policy's training ranks as one: what the learner service drives, at any rank count."""

    world: int
    """How many ranks train the policy (`[learner] ranks`)."""
    vocab_size: int
    """The policy's vocabulary size (what the intake checks token ids against)."""
    failed: str | None
    """Why the group is unusable (a rank failed), or None."""

    @property
    def model(self) -> nn.Module:
        """The whole current policy, unsharded (gathered from the ranks where they shard it)."""
        ...

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The AdamW this process holds for a whole-file checkpoint; None where each rank holds its shard's."""
        ...

    @property
    def sharded_writer(self) -> Callable[[Path], None] | None:
        """`Checkpoints.save`'s writer of a sharded checkpoint, or None for a whole-file one."""
        ...

    def step(self, groups: Sequence[Sequence[ScoredEpisode]], version: int, *, step: int = 0) -> StepStats:
        """One optimizer step over `groups` at policy `version` and learner `step` (`Trainer.step`'s contract)."""
        ...

    def stage_parts(
        self,
        version: int,
        staging_dir: str | Path,
        *,
        dtype: str = "",
        step_finished_at: float,
        extra: Mapping[str, str] | None = None,
    ) -> list[Path]:
        """Every rank stages its part of `version` into `rank_staging_dir(staging_dir, r, world)`; the files."""
        ...

    def restore(self, ckpt: Checkpoint) -> None:
        """Resume from a committed checkpoint, whatever rank count wrote it (RNG states included)."""
        ...

    def close(self) -> None:
        """Release what the group holds (rank actors, a local Ray); a second call does nothing."""
        ...

    def __enter__(self) -> Ranks: ...

    def __exit__(self, *exc: object) -> None: ...


class SingleRank:
    """A group of one rank: the policy trained in this process by one `Trainer`, exactly as it steps alone."""

    world = 1
    failed: str | None = None
    sharded_writer: Callable[[Path], None] | None = None
    """Whole-file checkpoints: the model and this process's AdamW state."""

    def __init__(self, trainer: Trainer, *, vocab_size: int) -> None:
        self.trainer = trainer
        self.vocab_size = vocab_size

    @property
    def model(self) -> nn.Module:
        return self.trainer.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.trainer.optimizer

    def step(self, groups: Sequence[Sequence[ScoredEpisode]], version: int, *, step: int = 0) -> StepStats:
        return self.trainer.step(groups, version, step=step)

    def stage_parts(
        self,
        version: int,
        staging_dir: str | Path,
        *,
        dtype: str = "",
        step_finished_at: float,
        extra: Mapping[str, str] | None = None,
    ) -> list[Path]:
        """The one rank's part is the whole version, staged into `staging_dir` itself."""
        where = rank_staging_dir(staging_dir, 0, 1)
        return [stage_model(where, version, self.model, dtype=dtype, step_finished_at=step_finished_at, extra=extra)]

    def restore(self, ckpt: Checkpoint) -> None:
        restore(ckpt, self.trainer.model, self.trainer.optimizer)

    def close(self) -> None:
        """Nothing to release: the policy lives and dies with this process."""

    def __enter__(self) -> SingleRank:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_ranks(source: ModelSource, section: LearnerSection, loss: LossConfig) -> Ranks:
    """The training ranks `section.ranks` asks for, built from `[model]` `source` (blocking: loads the model,
    and with ranks > 1 starts or joins Ray and its rank actors; call it off the event loop)."""
    if section.ranks > 1:
        return RankGroup(source, section, loss)  # this process becomes the ranks' Ray driver
    model, tokenizer = load_model(source)
    trainer = Trainer(model, section, loss, pad_id=tokenizer.pad_id)
    if trainer.autocast != section.autocast:
        log.warning(
            "bf16 autocast off: this CPU has no fast bf16 GEMM (AVX2 only), so the learner computes in fp32",
            requested=section.autocast,
            device=str(trainer.device),
        )
    return SingleRank(trainer, vocab_size=int(model.config.vocab_size))
