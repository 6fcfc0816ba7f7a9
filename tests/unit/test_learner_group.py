"""The learner's group of one rank (`group.SingleRank`, made by `open_ranks` for `[learner] ranks = 1`).

It must be the single-process learner exactly: the same steps bit for bit as a plain `Trainer`
over the same weights, the same staged files through the one hand-off, whole-file checkpoints
written and restored through the `Ranks` interface; and the hand-off refuses a group whose rank
count is not its own. (The Ray group behind the same interface: tests/integration/test_learner_ranks.py.)
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
import torch._dynamo  # torch.optim's first use imports it (~2 s): pay that at collection

from slipstream.engine.source import ModelSource, load_model
from slipstream.learner.checkpoint import Checkpoints
from slipstream.learner.config import LearnerSection
from slipstream.learner.group import Ranks, SingleRank, open_ranks
from slipstream.learner.handoff import WeightHandoff
from slipstream.learner.trainer import Trainer
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
from slipstream.weights.staging import list_staged, load_staged, rank_staging_dir, stage

pytestmark = pytest.mark.unit

SOURCE = ModelSource(preset="tiny", seed=5)
SECTION = LearnerSection(lr=3e-3, micro_batch=3, seed=0)
LOSS = LossConfig()


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def groups(seed: int) -> list[list[ScoredEpisode]]:
    """Two groups of four trajectories of varied lengths, rewards 0/1 within each group."""
    rng = random.Random(seed)
    out = []
    for g in range(2):
        group = []
        for i in range(4):
            prompt = [1, *(rng.randrange(3, 250) for _ in range(rng.randrange(2, 5)))]
            n = rng.choice([2, 4, 7])
            completion = [rng.randrange(3, 250) for _ in range(n - 1)] + [2]
            traj = Trajectory(
                trajectory_id=f"s{seed}g{g}e{i}",
                task_id=f"s{seed}g{g}",
                env="arith",
                group_id=f"s{seed}g{g}/g",
                group_size=4,
                prompt_len=len(prompt),
                token_ids=pack_ids(prompt + completion),
                logprobs=pack_floats([-math.log(259.0) + rng.uniform(-0.3, 0.3) for _ in range(n)]),
                loss_mask=pack_mask([1] * n),
                segments=[PolicySegment(0, n)],
            )
            reward = float(i % 2)
            group.append(scored_episode_from_v1(ScoredTrajectory(trajectory=traj, reward=reward, correct=reward > 0)))
        out.append(group)
    return out


def test_a_group_of_one_steps_bit_for_bit_as_the_trainer() -> None:
    ranks: Ranks = open_ranks(SOURCE, SECTION, LOSS)
    assert isinstance(ranks, SingleRank) and ranks.world == 1 and ranks.failed is None
    model, tok = load_model(SOURCE)
    plain = Trainer(model, SECTION, LOSS, pad_id=tok.pad_id)
    assert ranks.vocab_size == model.config.vocab_size
    for version in range(3):
        data = groups(version)
        a, b = ranks.step(data, version, step=version), plain.step(data, version, step=version)
        assert a.applied and b.applied
        assert (a.loss, a.grad_norm, a.n_tokens, a.figures) == (b.loss, b.grad_norm, b.n_tokens, b.figures)
    mine, theirs = ranks.model.state_dict(), plain.model.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert any(not torch.equal(mine[k], load_model(SOURCE)[0].state_dict()[k]) for k in mine)  # it trained
    ranks.close()
    ranks.close()  # nothing to release, twice


def test_the_handoff_stages_a_group_of_one_as_one_whole_model(tmp_path: Path) -> None:
    ranks = open_ranks(SOURCE, SECTION, LOSS)
    handoff = WeightHandoff(tmp_path / "staging", ranks=1, dtype="bfloat16")
    assert handoff.highest_staged() == -1
    files = handoff.stage_step(3, ranks, step_finished_at=12.5, fence={"fence_token": "7"}, trace_context={"a": "b"})
    assert files == [tmp_path / "staging" / "v00000003.safetensors"]
    by_model = WeightHandoff(tmp_path / "by-model", dtype="bfloat16")
    by_model.stage(3, ranks.model, step_finished_at=12.5, fence={"fence_token": "7"}, trace_context={"a": "b"})
    (one,), (two,) = list_staged(tmp_path / "staging"), list_staged(tmp_path / "by-model")
    assert (one.version, one.step_finished_at) == (two.version, two.step_finished_at) == (3, 12.5)
    got, expected = load_staged(one), load_staged(two)
    assert sorted(got) == sorted(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    assert {t.dtype for t in got.values()} == {torch.bfloat16}
    assert handoff.highest_staged() == 3


def test_the_handoff_refuses_a_group_of_another_rank_count(tmp_path: Path) -> None:
    ranks = open_ranks(SOURCE, SECTION, LOSS)
    two = WeightHandoff(tmp_path, ranks=2)
    with pytest.raises(ValueError, match="2 rank"):
        two.stage_step(0, ranks)
    with pytest.raises(ValueError, match="one rank's part"):
        two.stage(0, ranks.model)
    with pytest.raises(ValueError, match="ranks >= 1"):
        WeightHandoff(tmp_path, ranks=0)
    with pytest.raises(ValueError, match="int8"):
        WeightHandoff(tmp_path, dtype="int8")
    assert list(tmp_path.iterdir()) == []


def test_the_highest_staged_version_is_the_newest_of_any_rank(tmp_path: Path) -> None:
    handoff = WeightHandoff(tmp_path, ranks=2)
    assert handoff.highest_staged() == -1
    t = {"w": torch.zeros(2)}
    stage(rank_staging_dir(tmp_path, 0, 2), 4, t)
    stage(rank_staging_dir(tmp_path, 1, 2), 5, t)  # rank 1 staged one more before a crash
    assert handoff.highest_staged() == 5
    stage(tmp_path, 9, t)  # a one-rank learner's file, not a part of this run's ranks
    assert handoff.highest_staged() == 5


def test_a_checkpoint_of_a_group_of_one_resumes_another_exactly(tmp_path: Path) -> None:
    section = msgspec.structs.replace(SECTION, seed=1)
    ranks = open_ranks(SOURCE, section, LOSS)
    ranks.step(groups(0), 0)
    assert ranks.sharded_writer is None and ranks.optimizer is not None  # whole files: model and AdamW
    checkpoints = Checkpoints(LocalObjectStore(tmp_path), "run", keep=1)
    checkpoints.save(
        step=1,
        policy_version=1,
        model=ranks.model,
        optimizer=ranks.optimizer,
        sharded=ranks.sharded_writer,
        dropped={},
        trained_ids=["x"],
    )
    assert not any("/dcp/" in k for k in checkpoints.store.list("checkpoints/run/"))
    expected = ranks.step(groups(1), 1, step=1)
    ckpt = checkpoints.load_latest()
    assert ckpt is not None
    resumed = open_ranks(SOURCE, section, LOSS)
    resumed.restore(ckpt)
    got = resumed.step(groups(1), 1, step=1)
    assert (got.loss, got.grad_norm) == (expected.loss, expected.grad_norm)
    mine, theirs = resumed.model.state_dict(), ranks.model.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
