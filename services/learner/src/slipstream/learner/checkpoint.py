"""Learner checkpoints in the object store: what a restarted learner resumes from.

    checkpoints/<run_id>/step-<n>/model.safetensors   the policy's parameters
    checkpoints/<run_id>/step-<n>/optimizer.pt         AdamW state (torch.save; never on the wire)
    checkpoints/<run_id>/step-<n>/dcp/...              instead of optimizer.pt, from a learner with ranks > 1:
                                                       model and AdamW state as torch.distributed.checkpoint
                                                       wrote them (every rank's shards + .metadata),
                                                       readable at any rank count, 1 included
    checkpoints/<run_id>/step-<n>/rng.pt               torch RNG states
    checkpoints/<run_id>/step-<n>/meta.json            step, version, drop counts, python RNG,
                                                       trained trajectory ids, file sha256s
    checkpoints/<run_id>/latest.json                   the commit pointer, written last

A checkpoint is committed when `latest.json` names it; files of a checkpoint that was being
written when the process died are never read (and are deleted by the next commit). The pointer
also lists the retained chain, newest first, so a restarted learner knows exactly which
checkpoints are committed and which trajectory ids they cover: those ids form the idempotency
ledger that turns a redelivered, already-trained trajectory into a counted duplicate.
"""

from __future__ import annotations

import hashlib
import io
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

from slipstream.learner.version_state import unique_state
from slipstream.store import ObjectNotFound, ObjectStore

MODEL = "model.safetensors"
OPTIMIZER = "optimizer.pt"
RNG = "rng.pt"
META = "meta.json"
SHARDED = "dcp"


class CheckpointError(RuntimeError):
    """A committed checkpoint that cannot be read back (missing or corrupted file)."""


class CheckpointMeta(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What `meta.json` holds."""

    step: int
    policy_version: int
    run_id: str
    created_at: float
    dropped: dict[str, int] = {}
    trained_ids: list[str] = []
    trained_sequences: list[list[int]] = []
    """Per trained id, the stream sequences of its deliveries (for the outcome lines a resume restores)."""
    python_rng: list[Any] = []
    files: dict[str, str] = {}


class Pointer(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What `latest.json` holds: the committed chain, newest first."""

    step: int
    policy_version: int
    chain: list[str]
    fence_token: int = 0
    """The leader lease's fencing token of the learner that committed it (0 without a control plane)."""


@dataclass
class Checkpoint:
    """A committed checkpoint, read back and verified."""

    meta: CheckpointMeta
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    rng_state: dict[str, Any]
    chain_ids: list[list[str]]
    """Trained trajectory ids of every retained checkpoint, oldest first (the ledger's windows)."""
    sharded: dict[str, bytes] = field(default_factory=dict)
    """The torch.distributed.checkpoint files (relative path -> bytes, verified) of a checkpoint written
    by ranks; empty for a single-process one (then `optimizer_state` holds AdamW's state)."""

    def write_sharded(self, directory: str | Path) -> Path:
        """Lay the sharded files out in `directory` for torch.distributed.checkpoint to read."""
        root = Path(directory)
        for name, data in self.sharded.items():
            target = root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        return root


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _torch_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class Checkpoints:
    """Save, prune and load the checkpoints of one run (blocking; call off the event loop)."""

    def __init__(self, store: ObjectStore, run_id: str, *, keep: int, scratch_dir: str = "") -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.store = store
        self.run_id = run_id
        self.keep = keep
        self.scratch_dir = scratch_dir or None
        """Where a sharded writer's files pass through (`[learner] shared_dir`); None: the system temp dir."""
        self.root = f"checkpoints/{run_id}"

    def prefix(self, step: int) -> str:
        return f"{self.root}/step-{step:08d}"

    @property
    def pointer_key(self) -> str:
        return f"{self.root}/latest.json"

    # -- writing ----------------------------------------------------------------------------------
    def save(
        self,
        *,
        step: int,
        policy_version: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        dropped: dict[str, int],
        trained_ids: list[str],
        trained_sequences: list[list[int]] | None = None,
        fence_token: int = 0,
        sharded: Callable[[Path], None] | None = None,
    ) -> str:
        """Write every file, then the pointer (the commit); prune what fell out of the chain.

        `sharded` (a learner with ranks): called with an empty local directory, it writes the model and
        AdamW state there with torch.distributed.checkpoint; those files are stored under `dcp/` in
        place of `optimizer.pt` (`model` is still stored whole, for readers of the weights alone).

        With a control plane (`fence_token` > 0), a pointer written under a higher token means a
        newer leader committed: this learner was fenced and must not overwrite it.
        """
        prefix = self.prefix(step)
        previous = self._pointer()
        if fence_token and previous is not None and previous.fence_token > fence_token:
            raise CheckpointError(
                f"the committed checkpoint (step {previous.step}) was written under fencing token "
                f"{previous.fence_token}, above this learner's {fence_token}: another learner leads the run"
            )
        if previous is not None and step <= previous.step:
            raise CheckpointError(f"checkpoint step {step} is not after the committed step {previous.step}")
        rng: dict[str, Any] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        blobs = {
            MODEL: save_safetensors({k: v.detach().cpu().contiguous() for k, v in unique_state(model).items()}),
            RNG: _torch_bytes(rng),
        }
        if sharded is not None:
            with tempfile.TemporaryDirectory(prefix="slipstream-dcp-", dir=self.scratch_dir) as tmp:
                sharded(Path(tmp))
                for path in sorted(Path(tmp).rglob("*")):
                    if path.is_file():
                        blobs[f"{SHARDED}/{path.relative_to(tmp).as_posix()}"] = path.read_bytes()
            if f"{SHARDED}/.metadata" not in blobs:
                raise CheckpointError("the sharded checkpoint writer left no .metadata file")
        elif optimizer is None:
            raise ValueError("a checkpoint needs the optimizer, or a sharded writer")
        else:
            blobs[OPTIMIZER] = _torch_bytes(optimizer.state_dict())
        self.store.put_many({f"{prefix}/{name}": data for name, data in blobs.items()})
        meta = CheckpointMeta(
            step=step,
            policy_version=policy_version,
            run_id=self.run_id,
            created_at=time.time(),
            dropped=dict(dropped),
            trained_ids=list(trained_ids),
            trained_sequences=[list(seqs) for seqs in trained_sequences or []],
            python_rng=msgspec.to_builtins(random.getstate()),
            files={name: _sha256(data) for name, data in blobs.items()},
        )
        self.store.put(f"{prefix}/{META}", msgspec.json.encode(meta))
        chain = [prefix, *(previous.chain if previous else [])][: self.keep]
        pointer = Pointer(step=step, policy_version=policy_version, chain=chain, fence_token=fence_token)
        self.store.put(self.pointer_key, msgspec.json.encode(pointer))
        self._prune(set(chain))
        return prefix

    def _prune(self, keep: set[str]) -> None:
        for key in self.store.list(f"{self.root}/step-"):
            # step-<n>/<file> or step-<n>/dcp/<file>: the checkpoint is the first two parts of the key past the root
            if key[: key.index("/", len(self.root) + 1)] not in keep:
                self.store.delete(key)

    # -- reading ----------------------------------------------------------------------------------
    def _pointer(self) -> Pointer | None:
        try:
            raw = self.store.get(self.pointer_key)
        except ObjectNotFound:
            return None
        try:
            return msgspec.json.decode(raw, type=Pointer)
        except msgspec.DecodeError as exc:
            raise CheckpointError(f"{self.pointer_key} is not a checkpoint pointer: {exc}") from exc

    def _meta(self, prefix: str) -> CheckpointMeta:
        key = f"{prefix}/{META}"
        try:
            return msgspec.json.decode(self.store.get(key), type=CheckpointMeta)
        except ObjectNotFound:
            raise CheckpointError(f"committed checkpoint file {key} is missing") from None
        except msgspec.DecodeError as exc:
            raise CheckpointError(f"{key} does not decode: {exc}") from exc

    def _file(self, prefix: str, meta: CheckpointMeta, name: str) -> bytes:
        key = f"{prefix}/{name}"
        try:
            data = self.store.get(key)
        except ObjectNotFound:
            raise CheckpointError(f"committed checkpoint file {key} is missing") from None
        if _sha256(data) != meta.files.get(name):
            raise CheckpointError(f"checkpoint file {key} does not match the sha256 in its meta.json")
        return data

    def latest_step(self) -> int:
        """The committed step, or -1 when this run has no checkpoint."""
        pointer = self._pointer()
        return -1 if pointer is None else pointer.step

    def fence_token(self) -> int:
        """The fencing token the committed checkpoint was written under (0: none, or no control plane)."""
        pointer = self._pointer()
        return 0 if pointer is None else pointer.fence_token

    def load_latest(self) -> Checkpoint | None:
        """The newest committed checkpoint, verified, or None on a fresh run."""
        pointer = self._pointer()
        if pointer is None:
            return None
        newest = pointer.chain[0]
        meta = self._meta(newest)
        model_state = load_safetensors(self._file(newest, meta, MODEL))
        sharded = {
            name.removeprefix(f"{SHARDED}/"): self._file(newest, meta, name)
            for name in meta.files
            if name.startswith(f"{SHARDED}/")
        }
        optimizer_state: dict[str, Any] = {}
        if not sharded:
            optimizer_state = torch.load(io.BytesIO(self._file(newest, meta, OPTIMIZER)), weights_only=True)
        rng_state = torch.load(io.BytesIO(self._file(newest, meta, RNG)), weights_only=True)
        older = [self._meta(p).trained_ids for p in pointer.chain[1:]]
        chain_ids = [*reversed(older), meta.trained_ids]
        return Checkpoint(meta, model_state, optimizer_state, rng_state, chain_ids, sharded)


def restore(ckpt: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a checkpoint's model, optimizer and RNG states (hyperparameters from config win).

    A checkpoint written by ranks loads through torch.distributed.checkpoint into this process's
    model, whatever the rank count that wrote it.
    """
    if ckpt.sharded:
        from slipstream.learner.sharded_checkpoint import load_state

        with tempfile.TemporaryDirectory(prefix="slipstream-dcp-") as tmp:
            load_state(model, optimizer, ckpt.write_sharded(tmp))
    else:
        _restore_unsharded(ckpt, model, optimizer)
    restore_rng(ckpt)


def _restore_unsharded(ckpt: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    state = model.state_dict()
    missing = sorted(set(state) - set(ckpt.model_state))
    aliased = set(state) - set(unique_state(model))  # tied aliases, and the frozen base of a LoRA model
    if set(missing) - aliased or set(ckpt.model_state) - set(state):
        raise CheckpointError(
            f"checkpoint step {ckpt.meta.step} does not fit the model: missing {missing}, "
            f"unexpected {sorted(set(ckpt.model_state) - set(state))}"
        )
    model.load_state_dict(ckpt.model_state, strict=False)
    # The configured lr, betas, eps and weight decay apply after a restart (a run may change them).
    configured = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(ckpt.optimizer_state)
    for group, hyper in zip(optimizer.param_groups, configured, strict=True):
        group.update(hyper)


def restore_rng(ckpt: Checkpoint) -> None:
    """This process's torch and python RNGs as the checkpoint recorded them."""
    torch.set_rng_state(ckpt.rng_state["torch"])
    if "cuda" in ckpt.rng_state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(ckpt.rng_state["cuda"])
    version, internal, gauss = ckpt.meta.python_rng
    random.setstate((version, tuple(internal), gauss))
