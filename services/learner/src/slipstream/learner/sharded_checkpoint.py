"""Model and AdamW state through torch.distributed.checkpoint (DCP): written by every rank, read at any rank count.

DCP writes each rank's shards plus a `.metadata` file that says which slice of which tensor every
file holds, so a checkpoint written by 2 FSDP2 ranks loads into 1 process (full tensors) or into
N ranks (their own slices) alike. The same two functions run in a rank actor (inside a process
group) and in the single-process learner (no process group: DCP then reads and writes alone).

The files are written to a local directory; `Checkpoints.save` stores them in the object store
with the checkpoint's other files (sha256s in its meta.json, the pointer written last), and
`Checkpoints.load_latest` brings them back, verified.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn


class ShardedCheckpointError(RuntimeError):
    """A directory that holds no torch.distributed.checkpoint checkpoint."""


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # DCP warns that it assumes a single process when no process group exists: that is the intent here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=".*single process.*")
        yield


def save_state(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | Path) -> None:
    """Write `model`'s and `optimizer`'s state (sharded or not) to directory `path` (a collective under a
    process group: every rank calls it with the same path)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    with _quiet():
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))


def load_state(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | Path) -> None:
    """Read a checkpoint written by `save_state` at any rank count into `model` and `optimizer` (the configured
    lr, betas, eps and weight decay win over the checkpoint's, as in the single-file checkpoints)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not (Path(path) / ".metadata").is_file():
        raise ShardedCheckpointError(f"{path} holds no DCP checkpoint (no .metadata file)")
    configured = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    with _quiet():
        model_state, optim_state = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for group, hyper in zip(optimizer.param_groups, configured, strict=True):
        group.update(hyper)
