"""The hand-off of new weights from a learner rank to its weight-publisher, through a local directory.

They share a pod (an in-memory volume) in production and a directory on a laptop. The learner
writes `v<version>.safetensors` via a temp file and a rename, so the publisher never reads a
partial file, and goes on training; the publisher picks staged versions up in order, publishes
them and removes them. A learner with N ranks stages each rank's part of a version into
`<staging_dir>/rank-<r>` (`rank_staging_dir`), watched by that rank's publisher. Metadata
(version, end of the optimizer step, and what the learner adds: its fence, its step's trace
context) rides in the safetensors header.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, safe_open, save_file

_NAME = re.compile(r"^v(\d{8})\.safetensors$")


@dataclass(frozen=True)
class Staged:
    version: int
    path: Path
    step_finished_at: float
    metadata: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)
    """The file's whole metadata as staged (fence, the step's trace context, ...)."""


def rank_staging_dir(staging_dir: str | Path, rank: int, ranks: int) -> Path:
    """Where rank `rank` of a `ranks`-rank learner stages its part of each version (and its publisher watches):
    `staging_dir` itself for one rank, `<staging_dir>/rank-<rank>` otherwise."""
    if not 0 <= rank < max(ranks, 1):
        raise ValueError(f"rank {rank} is not one of {ranks} ranks")
    return Path(staging_dir) if ranks <= 1 else Path(staging_dir) / f"rank-{rank}"


def staged_path(staging_dir: str | Path, version: int) -> Path:
    return Path(staging_dir) / f"v{version:08d}.safetensors"


def stage(
    staging_dir: str | Path,
    version: int,
    tensors: Mapping[str, torch.Tensor],
    *,
    step_finished_at: float | None = None,
    extra: Mapping[str, str] | None = None,
) -> Path:
    """Write one version atomically (temp + rename). Returns the final path."""
    d = Path(staging_dir)
    d.mkdir(parents=True, exist_ok=True)
    final = staged_path(d, version)
    tmp = d / f".{final.name}.{os.getpid()}.tmp"
    meta = {"policy_version": str(version), "step_finished_at": repr(step_finished_at or time.time())}
    meta.update(extra or {})
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    save_file(cpu, str(tmp), metadata=meta)
    os.replace(tmp, final)
    return final


def list_staged(staging_dir: str | Path) -> list[Staged]:
    """Complete staged versions, oldest first (temp files are ignored)."""
    d = Path(staging_dir)
    if not d.is_dir():
        return []
    out: list[Staged] = []
    for p in d.iterdir():
        m = _NAME.match(p.name)
        if not m:
            continue
        try:
            with safe_open(str(p), framework="pt") as fh:
                meta = fh.metadata() or {}
        except (OSError, ValueError):
            continue  # being replaced right now; seen on the next scan
        out.append(Staged(int(m.group(1)), p, float(meta.get("step_finished_at", "0") or 0), dict(meta)))
    return sorted(out, key=lambda s: s.version)


def load_staged(staged: Staged) -> dict[str, torch.Tensor]:
    return load_file(str(staged.path))
