"""The learner as N training ranks on Ray: one FSDP2-sharded policy, each step's rows split across ranks.

    driver (this process)                     rank actors (Ray, 1 CPU each, one placement group)
    step_items(groups) -> rows, normaliser     Trainer over fully_shard(model): gloo on CPU
    pack(rows) -> rows per rank  ───────────►  accumulate(own micro-batches, step normaliser)
                                               FSDP2 reduce-scatters the *summed* gradient
    merge loss sums  ◄───────────────────────  apply(): global-norm clip, AdamW on own shard

A step over N ranks computes what `Trainer.step` computes in one process: every micro-batch's loss
is divided by the whole step's trained-token count, so per-rank gradients add up to the full
batch's, and FSDP2's gradient reduction is set to sum (divide factor 1) rather than average. Each
rank runs the same number of forward/backward passes (a rank short of rows runs passes that add
nothing), as every pass is a sequence of collectives that all ranks must join in the same order.

Every rank builds the policy from the same `[model]` source (a seeded preset or an HF directory),
so all start from the same weights. The driver keeps an unsharded mirror of the policy, refreshed
from the ranks on demand (`gathered_model`), for checkpoints' weights and evaluation; checkpoints go
through torch.distributed.checkpoint (`sharded_checkpoint`), readable at any rank count. Versions
are staged by the ranks themselves (`stage_parts`): rank r writes its part (a fixed partition of
the tensor names) into `<staging_dir>/rank-<r>`, which its own weight-publisher stores.

A rank that fails (its process killed, an error, a collective past `rank_timeout_s`) fails the
whole group: the driver reports the first failure as a `RankError` without waiting for the other
ranks (they may sit in a collective with the dead one), and `close` then kills every actor instead
of asking it to leave its process group. There is no in-process recovery: the learner service
exits 1 and its supervisor restarts it, so it resumes from its last checkpoint as any restarted
learner does (services/learner/README.md, "A dead rank").

Ray is imported only here, and only when a `RankGroup` is made: `ranks = 1` never imports it.
"""

from __future__ import annotations

import math
import os
import socket
import tempfile
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slipstream.engine.source import ModelSource, load_model
from slipstream.learner.checkpoint import Checkpoint, restore, restore_rng
from slipstream.learner.config import LearnerSection
from slipstream.learner.packing import Split, attention_weight_for, pack
from slipstream.learner.reference import make_reference
from slipstream.learner.sharded_checkpoint import load_state, save_state
from slipstream.learner.trainer import (
    StepStats,
    Trainer,
    merge_sums,
    micro_batches,
    step_items,
    step_stats,
    trained_tokens,
)
from slipstream.rl import LossConfig, TrainItem
from slipstream.rl.schedule import weights_at
from slipstream.schemas import ScoredEpisode
from slipstream.telemetry.logs import get_logger

log = get_logger(__name__)

RankResult = tuple[dict[str, float], dict[int, tuple[float, int]], float, int]
"""A rank's step: its loss sums, per-turn sums, the global gradient norm, the substeps applied (`Trainer.train`)."""


class RankError(RuntimeError):
    """A rank actor failed or could not be started; names the rank and what went wrong."""


def shard_model(model: nn.Module) -> None:
    """FSDP2 over `model` in place: each decoder layer is one unit, the root holds the rest (embedding, tied
    lm_head, final norm); gradients are summed across ranks, not averaged."""
    from torch.distributed.fsdp import fully_shard

    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"cannot shard {type(model).__name__}: no model.layers to make FSDP units of")
    units = [fully_shard(layer) for layer in layers]
    units.append(fully_shard(model))
    for unit in units:
        # Sum: every rank's loss is already divided by the whole step's token count. Plain SUM
        # collectives (no pre-multiplied sum, which gloo lacks) with a post-division by 1.
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)


class RankWorker:
    """One training rank (a Ray actor): its process group, its shard of the policy, its AdamW."""

    def __init__(self, rank: int, world: int, source: ModelSource, section: LearnerSection, loss: LossConfig) -> None:
        self.rank = rank
        self.world = world
        self.source = source
        self.section = section
        self.loss = loss
        self.trainer: Trainer | None = None

    def address(self) -> tuple[str, int]:
        """Where rank 0 listens for the process group's rendezvous: this node's IP and a free port."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return ray.util.get_node_ip_address(), port

    def setup(self, addr: str, port: int) -> int:
        """Join the process group, build and shard the policy; returns the parameter count."""
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(self.rank), WORLD_SIZE=str(self.world))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
            # Gloo advertises the address its host name resolves to, often 127.0.x.1: ranks on other
            # hosts then connect to their own loopback ("Connection refused"). The interface that holds
            # this node's Ray address is the one the other nodes reach.
            ifname = interface_of(self.node_ip())
            if ifname:
                os.environ["GLOO_SOCKET_IFNAME"] = ifname
        # The timeout bounds every collective: a rank whose peer hangs fails instead of waiting for ever.
        timeout = timedelta(seconds=self.section.rank_timeout_s)
        dist.init_process_group(backend, rank=self.rank, world_size=self.world, timeout=timeout)
        torch.manual_seed(self.section.seed)
        model, tokenizer = load_model(self.source)
        n_params = sum(p.numel() for p in model.parameters())
        # Before sharding: a full fine-tune's frozen copy stays whole on every rank, so its pass needs no
        # collective (a LoRA reference is the sharded policy itself, adapters off).
        reference = make_reference(model, self.loss)
        shard_model(model)
        self.trainer = Trainer(model, self.section, self.loss, pad_id=tokenizer.pad_id, reference=reference)
        return n_params

    def _trainer(self) -> Trainer:
        if self.trainer is None:
            raise RuntimeError(f"rank {self.rank} is not set up")
        return self.trainer

    def step(self, chunks: list[list[TrainItem]], total_tokens: int) -> RankResult:
        """Accumulate this rank's micro-batches, then clip and step together with the others (each substep)."""
        return self._trainer().train(chunks, total_tokens)

    def pid(self) -> int:
        """This rank's process id (for operators and the fault-injection tests)."""
        return os.getpid()

    def node_ip(self) -> str:
        """The address of the Ray node this rank runs on (which host holds it)."""
        import ray

        return str(ray.util.get_node_ip_address())

    def state_digest(self) -> str:
        """sha256 of the whole policy as this rank gathers it (names, dtypes, shapes, bytes); a collective.

        Every rank gathers every parameter from the shards, so equal digests say the ranks hold one policy."""
        import hashlib

        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self._trainer().model, options=StateDictOptions(full_state_dict=True))
        h = hashlib.sha256()
        for name in sorted(state):
            value = state[name]
            if isinstance(value, torch.Tensor):
                t = value.detach().to("cpu").contiguous()
                h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """The whole policy's state dict on rank 0 (None elsewhere); a collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self._trainer().model, options=options)
        if self.rank != 0:
            return None
        return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}

    def stage_part(
        self,
        version: int,
        names: list[str],
        staging_dir: str,
        dtype: str,
        step_finished_at: float,
        extra: dict[str, str],
    ) -> str:
        """Stage this rank's part of `version` (the tensors `names`) for its weight-publisher; a collective.

        Every rank gathers every parameter in full (FSDP2 all-gathers each) and keeps only its own
        names, so the file holds whole tensors: the publisher and the workers never see FSDP's slices.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from slipstream.learner.version_state import DTYPES
        from slipstream.weights.staging import rank_staging_dir, stage

        state = get_model_state_dict(self._trainer().model, options=StateDictOptions(full_state_dict=True))
        target = DTYPES.get(dtype)
        tensors = {}
        for name in names:
            value = state[name]
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"rank {self.rank}: state entry {name!r} is a {type(value).__name__}, not a tensor")
            t = value.detach().to("cpu")
            tensors[name] = t.to(target) if target is not None and t.is_floating_point() else t
        meta = {**extra, "rank": str(self.rank), "ranks": str(self.world)}
        where = rank_staging_dir(staging_dir, self.rank, self.world)
        return str(stage(where, version, tensors, step_finished_at=step_finished_at, extra=meta))

    def save(self, path: str) -> None:
        # The driver made `path`; a rank on another node that does not mount it would write its shards
        # into a directory of its own that the driver never reads.
        self._sees(path)
        trainer = self._trainer()
        save_state(trainer.model, trainer.optimizer, path)

    def load(self, path: str) -> None:
        self._sees(path)
        trainer = self._trainer()
        load_state(trainer.model, trainer.optimizer, path)

    def _sees(self, path: str) -> None:
        if not Path(path).is_dir():
            raise RankError(
                f"rank {self.rank} on {socket.gethostname()} cannot see the checkpoint directory {path} the driver "
                "made: ranks on other nodes need [learner] shared_dir, a directory every node mounts at one path"
            )

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def interface_of(address: str) -> str:
    """The name of the network interface that holds IPv4 `address` ("" if none here does; Linux only)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                got = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(got[20:24]) == address:
                return name
    return ""


def rank_bundles(world: int, rank_resource: str = "") -> list[dict[str, float]]:
    """The placement group's bundles, bundle r for rank r: one CPU each, and with `rank_resource` (a template
    with `{rank}`) one unit of rank r's own custom resource, so rank r lands on the node that advertises it."""
    if not rank_resource:
        return [{"CPU": 1.0} for _ in range(world)]
    return [{"CPU": 1.0, rank_resource.format(rank=r): 1.0} for r in range(world)]


def rank_chunks(items: Sequence[TrainItem], split: Split, micro_batch: int) -> list[list[list[TrainItem]]]:
    """Each rank's micro-batches; every rank gets the same number (the most any rank needs), some maybe empty."""
    per_rank = [[items[i] for i in rows] for rows in split.rows]
    count = max(1, max(math.ceil(len(rows) / micro_batch) for rows in per_rank))
    return [micro_batches(rows, micro_batch, count=count) for rows in per_rank]


class RankGroup:
    """N rank actors training one policy, driven from this process: the `Ranks` (group.py) of ranks > 1."""

    def __init__(self, source: ModelSource, section: LearnerSection, loss: LossConfig) -> None:
        if section.ranks < 2:
            raise ValueError(f"a RankGroup needs ranks >= 2, got {section.ranks} (ranks = 1 trains in-process)")
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.section = section
        self.loss = loss
        self.world = section.ranks
        self._ray = ray
        self._started_ray = False
        self._closed = False
        self.failed: str | None = None
        """Why the group is unusable (a rank failed), or None; set by the first `RankError` of a call."""
        bundles = rank_bundles(self.world, section.rank_resource)
        if not ray.is_initialized():
            if section.ray_address:
                ray.init(address=section.ray_address, log_to_driver=True)
            else:
                ray.init(
                    address="local",
                    num_cpus=self.world,
                    # One node holds every rank (and, locally, every rank's publisher): it offers each rank's resource.
                    resources={k: v for b in bundles for k, v in b.items() if k != "CPU"},
                    include_dashboard=False,
                    object_store_memory=256 * 1024 * 1024,
                    log_to_driver=True,
                    # Ray nices its workers to 15 by default: on a node shared with anything at the
                    # default priority (rollout workers, the reward model, a test suite) the ranks
                    # then got a few % of a core, 20x slower steps and 90 s to start on 2 loaded cores.
                    _system_config={"worker_niceness": 0},
                )
            self._started_ray = True
        self._pg = placement_group(bundles, strategy="PACK")
        self._remove_pg = remove_placement_group
        self.actors: list[Any] = []
        try:
            ready = self._pg.ready()
            ray.get(ready, timeout=section.rank_start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            have = ray.cluster_resources()  # before close: a Ray call after it would start a new local Ray
            wanted = sorted({k for b in bundles for k in b} - {"CPU"})
            self.close()
            raise RankError(
                f"Ray did not place {self.world} rank actors (bundles {bundles}) within "
                f"{section.rank_start_timeout_s} s: the cluster has {have.get('CPU', 0)} CPUs"
                + "".join(f", {have.get(k, 0)} {k}" for k in wanted)
            ) from None
        actor_cls = ray.remote(num_cpus=1)(RankWorker)
        self.actors = [
            actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=r)
            ).remote(r, self.world, source, section, loss)
            for r in range(self.world)
        ]
        limit = section.rank_start_timeout_s
        try:
            addr, port = self._get([self.actors[0].address.remote()], "report rank 0's address", limit)[0]
            self.n_params = self._get([a.setup.remote(addr, port) for a in self.actors], "set up", limit)[0]
            self.rank_pids: list[int] = self.pids()
            self.rank_nodes: list[str] = self._get([a.node_ip.remote() for a in self.actors], "report its node", 30.0)
            log.info("rank actors placed", ranks=self.world, nodes=self.rank_nodes, pids=self.rank_pids)
        except BaseException:
            self.close()  # no actors (nor a local Ray) left behind
            raise
        # The driver's unsharded mirror: what versions are staged and checkpoints' weights written from.
        self.mirror, tokenizer = load_model(source)
        self.pad_id = tokenizer.pad_id
        self.vocab_size = int(self.mirror.config.vocab_size)
        self.attention_weight = attention_weight_for(int(self.mirror.config.hidden_size))
        self.last_split: Split | None = None
        self._part_names: list[list[str]] | None = None
        self._mirror_step = 0
        self._steps = 0

    def _get(self, refs: list[Any], what: str, timeout: float | None = None) -> list[Any]:
        """The results of one call per rank (`refs[i]` from rank i), raising `RankError` at the first failure.

        Results are taken as they come, not in rank order: a dead rank 1 is reported while rank 0 still
        waits in a collective for it. What the other ranks did within a short grace is added to the message.
        """
        if self.failed is not None:
            raise RankError(f"the rank group failed earlier ({self.failed}); cannot {what}")
        ray = self._ray
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = list(refs)
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                late = ", ".join(str(refs.index(r)) for r in pending)
                self.failed = f"rank(s) {late} did not {what} within {timeout} s"
                raise RankError(f"the rank actors did not {what} within {timeout} s (still running: rank {late})")
            try:
                ray.get(ready[0])
            except ray.exceptions.RayError as exc:  # the actor died or was lost, or the call raised
                rank = self._name(refs.index(ready[0]))
                others = self._outcomes(refs, pending, grace_s=2.0)
                self.failed = f"{rank} failed to {what}"
                raise RankError(
                    f"{rank} failed to {what}: {_first_line(exc)}" + (f"; {others}" if others else "")
                ) from exc
        return list(ray.get(refs))

    def _outcomes(self, refs: list[Any], pending: list[Any], grace_s: float) -> str:
        """What the still-running calls of a failed round came to within `grace_s` (for the error message)."""
        ray = self._ray
        done, stuck = ray.wait(pending, num_returns=len(pending), timeout=grace_s) if pending else ([], [])
        parts = []
        for ref in done:
            try:
                ray.get(ref)
                parts.append(f"{self._name(refs.index(ref))} finished")
            except Exception as exc:
                parts.append(f"{self._name(refs.index(ref))}: {_first_line(exc)}")
        parts += [f"{self._name(refs.index(ref))} still running (in a collective with the failed one)" for ref in stuck]
        return "; ".join(parts)

    def pids(self) -> list[int]:
        """Every rank actor's process id, in rank order (asked of the actors)."""
        return [int(p) for p in self._get([a.pid.remote() for a in self.actors], "report its pid", 30.0)]

    def state_digests(self) -> list[str]:
        """Each rank's `RankWorker.state_digest`, in rank order: all equal while the ranks hold one policy."""
        return [str(d) for d in self._get([a.state_digest.remote() for a in self.actors], "digest the weights")]

    def _name(self, rank: int) -> str:
        pids = getattr(self, "rank_pids", None)
        nodes = getattr(self, "rank_nodes", None)
        where = f" on node {nodes[rank]}" if nodes else ""
        return f"rank {rank} (pid {pids[rank]}{where})" if pids else f"rank {rank}"

    def step(self, groups: Sequence[Sequence[ScoredEpisode]], version: int, *, step: int = 0) -> StepStats:
        """One optimizer step over `groups` across the ranks at learner `step` (see the module docstring)."""
        start = time.perf_counter()
        items = step_items(groups, self.section, step=step)
        total = trained_tokens(items)
        split = pack(items, self.world, attention_weight=self.attention_weight)
        chunks = rank_chunks(items, split, self.section.micro_batch)
        results: list[RankResult] = self._get(
            [a.step.remote(c, total) for a, c in zip(self.actors, chunks, strict=True)], "train a step"
        )
        sums, by_turn = merge_sums([(r[0], r[1]) for r in results])
        # The norm is global and every rank applies (or skips) the same substeps: rank 0's stand for all.
        grad_norm, substeps = results[0][2], results[0][3]
        self.last_split = split
        self._steps += 1
        return step_stats(
            groups,
            version,
            items,
            sums=sums,
            by_turn=by_turn,
            grad_norm=grad_norm,
            applied=substeps > 0,
            time_s=time.perf_counter() - start,
            weights=weights_at(self.section.reward_schedule, step),
            step_means=self.section.step_means,
            substeps=substeps,
        )

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole policy's current state dict, gathered from the ranks."""
        states = self._get([a.full_state.remote() for a in self.actors], "gather the weights")
        state = states[0]
        assert state is not None
        return state

    def part_names(self) -> list[list[str]]:
        """The tensor names each rank stages (`slipstream.weights.parts.partition` of what a version holds)."""
        if self._part_names is None:
            from slipstream.learner.version_state import unique_state
            from slipstream.weights.parts import partition

            state = unique_state(self.mirror)
            self._part_names = partition([(n, t.numel() * t.element_size()) for n, t in state.items()], self.world)
        return self._part_names

    def stage_parts(
        self,
        version: int,
        staging_dir: str | Path,
        *,
        dtype: str = "",
        step_finished_at: float,
        extra: Mapping[str, str] | None = None,
    ) -> list[Path]:
        """Every rank stages its part of `version` into `<staging_dir>/rank-<r>`, for that rank's publisher."""
        names = self.part_names()
        refs = [
            a.stage_part.remote(version, names[r], str(staging_dir), dtype, step_finished_at, dict(extra or {}))
            for r, a in enumerate(self.actors)
        ]
        return [Path(p) for p in self._get(refs, "stage their parts of a version")]

    def gathered_model(self) -> nn.Module:
        """The driver's unsharded mirror, refreshed from the ranks if a step ran since the last refresh."""
        if self._mirror_step != self._steps:
            self.mirror.load_state_dict(self.full_state())
            self._mirror_step = self._steps
        return self.mirror

    # -- the checkpoint's parts (`Ranks`): the gathered model, no driver optimizer, a sharded writer -----
    optimizer: torch.optim.Optimizer | None = None
    """No optimizer in the driver: each rank holds AdamW's state for its shard (see `sharded_writer`)."""

    @property
    def model(self) -> nn.Module:
        """The whole current policy (the gathered mirror), as `Trainer.model` is."""
        return self.gathered_model()

    def sharded_writer(self, path: Path) -> None:
        """`Checkpoints.save`'s writer: model and AdamW state of every rank into `path`."""
        self.save(path)

    def restore(self, ckpt: Checkpoint) -> None:
        """Resume from a committed checkpoint: one written by ranks (any count) loads as it is; one written by
        the single-process learner is first turned into a DCP checkpoint here (mirror + a local AdamW)."""
        with tempfile.TemporaryDirectory(prefix="slipstream-dcp-", dir=self.section.shared_dir or None) as tmp:
            if ckpt.sharded:
                ckpt.write_sharded(tmp)
            else:
                local = Trainer(self.mirror, self.section, self.loss, pad_id=self.pad_id, reference=None)
                restore(ckpt, local.model, local.optimizer)
                save_state(local.model, local.optimizer, tmp)
            self.load(tmp)
        restore_rng(ckpt)

    def save(self, path: str | Path) -> None:
        """Every rank writes its shards (and rank 0 the metadata) to directory `path` (this node's disk)."""
        self._get([a.save.remote(str(path)) for a in self.actors], "save a checkpoint")

    def load(self, path: str | Path) -> None:
        """Every rank reads its slice of the checkpoint in `path`, written at any rank count."""
        self._get([a.load.remote(str(path)) for a in self.actors], "load a checkpoint")
        self._steps += 1  # the mirror is stale

    def close(self) -> None:
        """Stop the ranks (and Ray, if this group started it). After a failure the actors are killed at once:
        the survivors may be waiting in a collective with the failed rank and would not take a `close` call.
        Only the first call acts: a second one must not touch Ray (any Ray call would start a new local Ray)."""
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        if self.actors:
            if self.failed is None:
                try:
                    ray.get([a.close.remote() for a in self.actors], timeout=30)
                except Exception:
                    pass
            for a in self.actors:
                ray.kill(a)
            self.actors = []
        try:
            self._remove_pg(self._pg)
        except Exception:
            pass
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _first_line(exc: BaseException) -> str:
    """The first line of what went wrong: a task error's own exception (Ray wraps it with a traceback),
    else the first line of the text (an actor error goes on with the actor's details)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__
