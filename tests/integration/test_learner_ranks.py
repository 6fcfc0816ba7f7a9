"""The learner as 2 FSDP2 ranks on a local Ray (gloo, CPU) against the single-process learner, both driven
through the one `Ranks` interface the service uses (`open_ranks`: a group of one in-process, a Ray group).

Same seed, same data: the loss of every step and the weights after 5 steps agree within float
tolerance (the ranks sum the same per-token terms in another order), and a checkpoint written by
the 2 ranks (torch.distributed.checkpoint, committed to the object store as the service does)
resumes in one process and at 2 ranks, each continuing as the run that wrote it; the ranks also
resume from a single-process checkpoint. One rank group serves the whole file: starting Ray and
its actors is most of this file's time.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from slipstream.engine.source import ModelSource
from slipstream.learner.checkpoint import Checkpoints
from slipstream.learner.config import LearnerSection
from slipstream.learner.group import Ranks, SingleRank, open_ranks
from slipstream.learner.ranks import RankGroup
from slipstream.rl import LossConfig
from slipstream.schemas import (
    PolicySegment,
    ScoredEpisode,
    ScoredTrajectory,
    Trajectory,
    pack_floats,
    pack_ids,
    pack_mask,
    scored_episode_from_v1,
)
from slipstream.store import LocalObjectStore

pytestmark = [
    pytest.mark.integration,
    # Ray's own start-up emits warnings this suite does not own.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

SOURCE = ModelSource(preset="tiny", seed=3)
# lr high enough that 5 steps move every weight; micro_batch 3 makes each rank run several passes,
# some ranks an empty one; grad_clip low enough to clip (the global norm must be the same on every rank).
SECTION = LearnerSection(ranks=2, lr=3e-3, micro_batch=3, grad_clip=0.02, seed=0, rank_start_timeout_s=60.0)
LOSS = LossConfig()
STEPS = 5


def episode(rng: random.Random, tid: str, group: str, size: int) -> ScoredEpisode:
    prompt = [1, *(rng.randrange(3, 250) for _ in range(rng.randrange(2, 6)))]
    n = rng.choice([2, 3, 5, 9, 17])
    completion = [rng.randrange(3, 250) for _ in range(n - 1)] + [2]
    traj = Trajectory(
        trajectory_id=tid,
        task_id=group,
        env="arith",
        group_id=f"{group}/g",
        group_size=size,
        prompt_len=len(prompt),
        token_ids=pack_ids(prompt + completion),
        logprobs=pack_floats([-math.log(259.0) + rng.uniform(-0.3, 0.3) for _ in range(n)]),
        loss_mask=pack_mask([1] * n),
        segments=[PolicySegment(0, n)],
    )
    reward = float(rng.random() < 0.5)
    return scored_episode_from_v1(ScoredTrajectory(trajectory=traj, reward=reward, correct=reward > 0.5))


def steps_data(seed: int, steps: int) -> list[list[list[ScoredEpisode]]]:
    rng = random.Random(seed)
    out = []
    for s in range(steps):
        groups = []
        for g in range(3):
            size = 4
            groups.append([episode(rng, f"s{s}g{g}e{i}", f"s{s}g{g}", size) for i in range(size)])
        out.append(groups)
    return out


def in_process() -> Ranks:
    group = open_ranks(SOURCE, msgspec.structs.replace(SECTION, ranks=1), LOSS)
    assert isinstance(group, SingleRank)  # in this process: no Ray
    return group


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 2e-5) -> None:
    assert set(a) == set(b)
    for name in a:
        diff = float((a[name].float() - b[name].float()).abs().max())
        assert diff <= atol, f"{name} differs by {diff}"


@pytest.fixture(scope="module")
def ranks() -> Iterator[RankGroup]:
    group = open_ranks(SOURCE, SECTION, LOSS)
    assert isinstance(group, RankGroup)
    try:
        yield group
    finally:
        group.close()


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_rank_actors_run_at_the_drivers_priority(ranks: RankGroup) -> None:
    # Ray's default nices its workers to 15: next to anything at the default priority they starved
    # (steps 20x slower, 90 s to start, on 2 loaded cores).
    driver = os.getpriority(os.PRIO_PROCESS, 0)
    assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in ranks.rank_pids] == [driver] * SECTION.ranks


def test_two_ranks_train_as_one_process(ranks: RankGroup, tmp_path: Path) -> None:
    data = steps_data(seed=11, steps=STEPS + 1)
    single = in_process()
    initial = {k: v.clone() for k, v in single.model.state_dict().items()}
    for version, groups in enumerate(data[:STEPS]):
        one = single.step(groups, version)
        two = ranks.step(groups, version)
        assert one.applied and two.applied
        assert two.loss == pytest.approx(one.loss, rel=1e-5, abs=1e-7), f"step {version}"
        assert two.grad_norm == pytest.approx(one.grad_norm, rel=1e-4)
        assert two.n_tokens == one.n_tokens and two.n_samples == one.n_samples
        assert two.figures["ratio_mean"] == pytest.approx(one.figures["ratio_mean"], rel=1e-5)
        assert ranks.last_split is not None and all(ranks.last_split.rows)  # both ranks trained rows
    assert one.grad_norm > SECTION.grad_clip  # the clip was exercised
    gathered = {k: v.clone() for k, v in ranks.gathered_model().state_dict().items()}
    assert_same_weights(gathered, single.model.state_dict())
    moved = max(float((gathered[k] - initial[k]).abs().max()) for k in initial)
    assert moved > 1e-3  # the comparison is not between two untouched models

    # -- a checkpoint written at 2 ranks (DCP), committed to the object store as the service does ----
    store = LocalObjectStore(tmp_path / "store")
    ranks_ckpts = Checkpoints(store, "two-ranks", keep=2)
    ranks_ckpts.save(
        step=STEPS,
        policy_version=STEPS,
        model=ranks.model,
        optimizer=ranks.optimizer,
        dropped={},
        trained_ids=["t"],
        sharded=ranks.sharded_writer,
    )
    assert any(k.endswith("/dcp/.metadata") for k in store.list("checkpoints/two-ranks/"))
    # ... and one written by the single process at the same point, to resume the ranks from.
    single_ckpts = Checkpoints(store, "one-process", keep=2)
    single_ckpts.save(
        step=STEPS,
        policy_version=STEPS,
        model=single.model,
        optimizer=single.optimizer,
        dropped={},
        trained_ids=[],
        sharded=single.sharded_writer,
    )
    after = data[STEPS]
    expected = ranks.step(after, STEPS)  # how the writing run continues
    final = {k: v.clone() for k, v in ranks.model.state_dict().items()}

    # resumed in one process
    ckpt = ranks_ckpts.load_latest()
    assert ckpt is not None and ckpt.sharded and not ckpt.optimizer_state
    resumed = in_process()
    resumed.restore(ckpt)
    assert_same_weights(resumed.model.state_dict(), gathered, atol=0.0)
    got = resumed.step(after, STEPS)
    assert got.loss == pytest.approx(expected.loss, rel=1e-5, abs=1e-7)
    assert_same_weights(resumed.model.state_dict(), final)

    # resumed at 2 ranks: the group (one step past the checkpoint) goes back to it and continues the same way
    ranks.restore(ckpt)
    assert_same_weights(ranks.model.state_dict(), gathered, atol=0.0)
    again = ranks.step(after, STEPS)
    assert again.loss == pytest.approx(expected.loss, rel=1e-5, abs=1e-7)
    assert_same_weights(ranks.model.state_dict(), final)

    # and from the single-process checkpoint: the ranks take its weights and AdamW state
    one = single_ckpts.load_latest()
    assert one is not None and not one.sharded
    ranks.restore(one)
    assert_same_weights(ranks.model.state_dict(), gathered)
    assert ranks.step(after, STEPS).loss == pytest.approx(expected.loss, rel=1e-5, abs=1e-7)
    assert_same_weights(ranks.model.state_dict(), final)


def test_a_group_of_one_is_refused() -> None:
    with pytest.raises(ValueError, match="ranks >= 2"):
        RankGroup(SOURCE, LearnerSection(ranks=1), LOSS)
