"""Where a (re)started learner's version numbering continues, so no version number is ever reused.

Manifests are write-once and workers key everything on `policy_version`, so after a crash the
learner must not produce a version that already exists anywhere: announced on
`weights.announce`, stored in the object store (a manifest the announce of which was lost), or
staged in the hand-off directory but not yet published. The current version is the highest of
those and the checkpoint's; the next step produces that + 1. A run with none of them is fresh
and stages its initial weights as version 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from dataclasses import dataclass, field

import torch

from slipstream.bus import Bus
from slipstream.learner.checkpoint import CheckpointMeta, Checkpoints
from slipstream.learner.group import Ranks
from slipstream.learner.handoff import WeightHandoff
from slipstream.schemas import WeightAnnounce
from slipstream.schemas.subjects import WEIGHTS_ANNOUNCE
from slipstream.store import ObjectStore
from slipstream.weights.layout import version_of_manifest_key

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumePoint:
    """Where the learner stands after start-up, and what it was derived from (for the log)."""

    step: int
    version: int
    checkpoint_version: int
    """-1 without a checkpoint."""
    announced: int
    published: int
    staged: int
    dropped: dict[str, int] = field(default_factory=dict)
    chain_ids: list[list[str]] = field(default_factory=list)
    """Trained ids of the retained checkpoints, oldest first (the duplicate ledger's windows)."""
    committed: CheckpointMeta | None = None
    """The restored checkpoint's meta (its outcome lines may be missing: `OutcomeLog.restore_trained`)."""


async def last_announced(bus: Bus, run_id: str, timeout_s: float) -> int:
    """The version of the newest `weights.announce` if it belongs to `run_id`, else -1.

    Only the newest message of the subject is read (deliver="last"); an older announce of this
    run hidden behind another run's is still found in the object store (`last_published`).
    """
    if timeout_s <= 0:
        return -1
    reader = bus.subscribe(WEIGHTS_ANNOUNCE, WeightAnnounce, deliver="last")
    try:
        delivery = await asyncio.wait_for(anext(reader), timeout_s)
    except (TimeoutError, StopAsyncIteration):
        return -1
    finally:
        with contextlib.suppress(Exception):  # closing a reader that never opened may complain; nothing is lost
            await reader.close()
    announce = delivery.msg
    if announce.run_id and announce.run_id != run_id:
        log.info("last weights.announce is of run %s, not %s; ignored", announce.run_id, run_id)
        return -1
    return announce.policy_version


def last_published(store: ObjectStore, run_id: str) -> int:
    """The highest version of `run_id` with a committed manifest in the object store, else -1."""
    versions = [
        version_of_manifest_key(key) for key in store.list(f"weights/{run_id}/") if key.endswith("/manifest.json")
    ]
    return max(versions, default=-1)


def current_version(*, checkpoint: int, announced: int, published: int, staged: int) -> int:
    """The version the learner holds after a (re)start; -1 means a fresh run (stage version 0)."""
    return max(checkpoint, announced, published, staged)


async def resume(
    *,
    bus: Bus,
    store: ObjectStore,
    checkpoints: Checkpoints,
    handoff: WeightHandoff,
    ranks: Ranks,
    seed: int,
    announce_timeout_s: float,
) -> ResumePoint:
    """Restore the newest committed checkpoint into `ranks` (or seed a fresh run) and fix the version.

    A fresh run (no checkpoint, no version known anywhere) stages its initial weights as version
    0, so a worker that joins late can always fetch a complete version.
    """
    ckpt = await asyncio.to_thread(checkpoints.load_latest)
    if ckpt is not None:
        # Blocking: a group of one loads in this thread's process, rank actors each load their slice.
        await asyncio.to_thread(ranks.restore, ckpt)
    else:
        torch.manual_seed(seed)
        random.seed(seed)
    ckpt_version = ckpt.meta.policy_version if ckpt is not None else -1
    announced = await last_announced(bus, checkpoints.run_id, announce_timeout_s)
    published = await asyncio.to_thread(last_published, store, checkpoints.run_id)
    staged = await asyncio.to_thread(handoff.highest_staged)
    version = current_version(checkpoint=ckpt_version, announced=announced, published=published, staged=staged)
    if version < 0:
        await asyncio.to_thread(handoff.stage_step, 0, ranks)
        version = 0
    return ResumePoint(
        step=ckpt.meta.step if ckpt is not None else 0,
        version=version,
        checkpoint_version=ckpt_version,
        announced=announced,
        published=published,
        staged=staged,
        dropped=dict(ckpt.meta.dropped) if ckpt is not None else {},
        chain_ids=ckpt.chain_ids if ckpt is not None else [],
        committed=ckpt.meta if ckpt is not None else None,
    )
