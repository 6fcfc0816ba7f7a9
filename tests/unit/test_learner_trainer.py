"""The learner's optimizer step on the tiny model: advantages, accumulation, on-policy ratios, skips, learning."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Literal

import pytest
import torch
import torch._dynamo  # torch.optim's first use imports it (~2 s): pay that at collection

from slipstream.engine import build_tiny
from slipstream.engine.kernels import upcast_bf16_default
from slipstream.learner.config import LearnerSection
from slipstream.learner.trainer import Trainer, effective_autocast, staleness_histogram, train_items
from slipstream.rl import LossConfig, token_logprobs
from slipstream.schemas import (
    Episode,
    PolicySegment,
    Sample,
    ScoredEpisode,
    ScoredTrajectory,
    ToolEvent,
    Trajectory,
    Turn,
    pack_floats,
    pack_ids,
    pack_mask,
    scored_episode_from_v1,
)

pytestmark = pytest.mark.unit

PROMPT = [1, 50, 51, 52]


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # Two cores shared by several processes: more intra-op threads only oversubscribe them.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def scored(
    tid: str,
    completion: list[int],
    reward: float,
    *,
    version: int = 0,
    behaviour: list[float] | None = None,
    correct: bool = False,
) -> ScoredEpisode:
    n = len(completion)
    traj = Trajectory(
        trajectory_id=tid,
        task_id="t",
        env="arith",
        group_id="t/g",
        group_size=2,
        prompt_len=len(PROMPT),
        token_ids=pack_ids(PROMPT + completion),
        logprobs=pack_floats(behaviour if behaviour is not None else [-math.log(259.0)] * n),
        loss_mask=pack_mask([1] * n),
        segments=[PolicySegment(version, n)],
    )
    return scored_episode_from_v1(ScoredTrajectory(trajectory=traj, reward=reward, correct=correct))


def trainer(seed: int = 0, **section: object) -> Trainer:
    model, tok = build_tiny("tiny", seed=seed)
    return Trainer(model, LearnerSection(**section), LossConfig(), pad_id=tok.pad_id)  # type: ignore[arg-type]


def behaviour_of(t: Trainer, completion: list[int], temperature: float) -> list[float]:
    ids = torch.tensor([PROMPT + completion])
    with torch.no_grad():
        logits = t.model(ids)[:, :-1]
        lp = token_logprobs(logits, ids[:, 1:], temperature=temperature)[0]
    return lp[len(PROMPT) - 1 :].tolist()


def test_train_items_carry_reward_minus_group_mean() -> None:
    group = [scored("a", [60, 61], 1.0), scored("b", [62], 0.0), scored("c", [63, 64, 65], 0.5)]
    items = train_items(group)
    assert [i.advantage for i in items] == pytest.approx([0.5, -0.5, 0.0])
    assert [list(i.token_ids) for i in items] == [[*PROMPT, 60, 61], [*PROMPT, 62], [*PROMPT, 63, 64, 65]]
    assert all(i.prompt_len == 4 for i in items)
    std = train_items(group, normalize_std=True)
    assert std[0].advantage == pytest.approx(0.5 / math.sqrt(1 / 6), rel=1e-4)


def test_staleness_histogram_counts_versions_behind_of_the_oldest_token() -> None:
    a = scored("a", [60], 1.0, version=5)
    b = scored("b", [60, 61], 0.0)
    b.episode.samples[0].segments = [PolicySegment(3, 1), PolicySegment(5, 1)]
    c = scored("c", [60], 0.0, version=4)
    assert staleness_histogram([a, b, c], version=5) == {"0": 1, "1": 1, "2": 1}


def test_a_step_updates_the_policy_and_reports_what_it_trained_on() -> None:
    t = trainer(lr=1e-3)
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    groups = [
        [scored("a", [60, 61, 62], 1.0, correct=True), scored("b", [70, 71], 0.0)],
        [scored("c", [80], 0.0, version=1), scored("d", [81, 82], 1.0, version=1, correct=True)],
    ]
    stats = t.step(groups, version=1)
    assert stats.applied
    assert (stats.n_trajectories, stats.n_groups, stats.n_tokens) == (4, 2, 8)
    assert stats.reward_mean == pytest.approx(0.5) and stats.accuracy == pytest.approx(0.5)
    assert stats.staleness == {"0": 2, "1": 2}
    assert stats.grad_norm > 0 and math.isfinite(stats.loss)
    changed = [k for k, v in t.model.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) == len(before)  # every parameter moved (embeddings of the seen tokens included)
    assert all(p.grad is None for p in t.model.parameters())  # nothing left over for the next step


def test_bf16_autocast_is_kept_where_bf16_is_fast_and_dropped_for_fp32_where_it_is_slow() -> None:
    assert effective_autocast("", torch.device("cpu")) == ""
    assert effective_autocast("bfloat16", torch.device("cuda")) == "bfloat16"
    slow = upcast_bf16_default(torch.device("cpu"))  # an x86 CPU without AVX-512 (this one, where CI runs)
    assert effective_autocast("bfloat16", torch.device("cpu")) == ("" if slow else "bfloat16")
    asked, plain = trainer(lr=1e-3, autocast="bfloat16"), trainer(lr=1e-3)
    assert asked.autocast == ("" if slow else "bfloat16")
    groups = [[scored("a", [60, 61, 62], 1.0, correct=True), scored("b", [70, 71], 0.0)]]
    a, p = asked.step(groups, version=0), plain.step(groups, version=0)
    if slow:  # the step asked for bf16 is the fp32 step, to the bit
        assert a.loss == p.loss and a.grad_norm == p.grad_norm
        assert all(torch.equal(x, y) for x, y in zip(asked.model.parameters(), plain.model.parameters(), strict=True))
    else:
        assert a.loss != p.loss  # bf16 matmuls round differently


@pytest.mark.parametrize("normalizer", ["constant", "tokens"])
def test_micro_batches_accumulate_to_the_full_batch_gradient(normalizer: Literal["constant", "tokens"]) -> None:
    groups = [
        [scored("a", [60, 61, 62], 1.0), scored("b", [70, 71], 0.0), scored("c", [72], 0.5)],
        [scored("d", [80, 81, 82, 83], 0.0), scored("e", [84], 1.0)],
    ]
    grads = []
    for micro in (1, 2, 16):
        model, tok = build_tiny("tiny", seed=3)
        t = Trainer(
            model,
            LearnerSection(micro_batch=micro, grad_clip=0.0),
            LossConfig(normalizer=normalizer),
            pad_id=tok.pad_id,
        )  # type: ignore[arg-type]
        captured: dict[str, torch.Tensor] = {}

        def capture(t: Trainer = t, captured: dict[str, torch.Tensor] = captured) -> None:
            captured.update({n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None})

        t.optimizer.step = capture  # type: ignore[method-assign]
        t.step(groups, version=0)
        grads.append(captured)
    for other in grads[1:]:
        assert other.keys() == grads[0].keys()
        for name, g in grads[0].items():
            torch.testing.assert_close(other[name], g, rtol=1e-4, atol=1e-7)


def test_on_policy_ratios_are_one_when_the_temperature_matches() -> None:
    t = trainer(sampling_temperature=0.7)
    comps = [[60, 61, 62], [70, 71]]
    group = [scored(str(i), c, float(i), behaviour=behaviour_of(t, c, 0.7)) for i, c in enumerate(comps)]
    stats = t.step([group], version=0)
    assert stats.figures["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert stats.figures["clip_fraction"] == 0.0
    # Recomputed at the wrong temperature, the same behaviour log-probs are off-policy from step one.
    t2 = trainer(sampling_temperature=1.0)
    stats2 = t2.step([group], version=0)
    assert abs(stats2.figures["ratio_mean"] - 1.0) > 1e-3


def test_a_non_finite_gradient_skips_the_update() -> None:
    t = trainer()
    with torch.no_grad():
        t.model.lm_head.weight[0, 0] = float("nan")
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    stats = t.step([[scored("a", [60], 1.0), scored("b", [61], 0.0)]], version=0)
    assert not stats.applied and not math.isfinite(stats.grad_norm)
    after = t.model.state_dict()
    assert all(torch.equal(after[k], v) or k == "lm_head.weight" for k, v in before.items())
    assert torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    assert t.optimizer.state == {}  # AdamW never stepped


def test_repeated_steps_raise_the_rewarded_completion_and_lower_the_other() -> None:
    t = trainer(lr=3e-3)
    good, bad = [60, 61], [70, 71]

    def logprob(c: list[int]) -> float:
        return sum(behaviour_of(t, c, 1.0))

    start = (logprob(good), logprob(bad))
    for _ in range(4):
        group = [
            scored("g", good, 1.0, behaviour=behaviour_of(t, good, 1.0)),
            scored("b", bad, 0.0, behaviour=behaviour_of(t, bad, 1.0)),
        ]
        assert t.step([group], version=0).applied
    assert logprob(good) > start[0] + 0.5
    assert logprob(bad) < start[1] - 0.5


def test_a_step_needs_groups() -> None:
    with pytest.raises(ValueError, match="at least one group"):
        trainer().step([], version=0)


def agentic(eid: str, reward: float, t: Trainer) -> ScoredEpisode:
    """Policy turn [60, 61], tool result [90, 91] (masked), policy turn [62]; a summary branch; a frozen helper."""
    first = [60, 61, 90, 91, 62]
    mask = [1, 1, 0, 0, 1]
    lp = behaviour_of(t, first, 1.0)
    root = Sample(
        sample_id=f"{eid}/0",
        prompt_len=len(PROMPT),
        token_ids=pack_ids(PROMPT + first),
        logprobs=pack_floats([x if m else 0.0 for x, m in zip(lp, mask, strict=True)]),
        loss_mask=pack_mask(mask),
        segments=[PolicySegment(0, 5)],
        turns=[
            Turn(role="policy", start=4, end=6),
            Turn(role="tool", start=6, end=8),
            Turn(role="policy", start=8, end=9),
        ],
    )
    summary = Sample(
        sample_id=f"{eid}/1",
        role="summary",
        prompt_len=len(PROMPT),
        token_ids=pack_ids([*PROMPT, 63]),
        logprobs=pack_floats(behaviour_of(t, [63], 1.0)),
        loss_mask=pack_mask([1]),
        segments=[PolicySegment(0, 1)],
        branch_of=f"{eid}/0",
        branch_pos=9,
        edit="summary",
    )
    helper = Sample(
        sample_id=f"{eid}/2",
        agent_id="helper",
        trainable=False,
        prompt_len=1,
        token_ids=pack_ids([1, 70, 71]),
        logprobs=pack_floats([-1.0, -1.0]),
        loss_mask=pack_mask([1, 1]),
        segments=[PolicySegment(0, 2)],
    )
    ep = Episode(
        episode_id=eid,
        task_id="t",
        env="tools",
        group_id="g",
        group_size=2,
        samples=[root, summary, helper],
        tool_log=[
            ToolEvent(sample_id=f"{eid}/0", name="calc", arguments="{}"),
            ToolEvent(sample_id=f"{eid}/0", name="calc", arguments="{", status="invalid_tool_call"),
        ],
        counts={"turns": 3, "tool_calls": 2, "invalid_tool_call": 1},
    )
    return ScoredEpisode(episode=ep, reward=reward, correct=reward > 0.5)


def test_a_multi_sample_episode_trains_its_sampled_tokens_and_reports_its_shape() -> None:
    t = trainer(lr=1e-3)
    group = [agentic("a", 1.0, t), agentic("b", 0.0, t)]
    items = train_items(group)
    # Two trainable samples per episode; the frozen helper produces no row.
    assert [list(i.token_ids) for i in items[:2]] == [[*PROMPT, 60, 61, 90, 91, 62], [*PROMPT, 63]]
    assert [i.advantage for i in items] == [0.5, 0.5, -0.5, -0.5]
    assert list(items[0].turn_index) == [0, 0, -1, -1, 1] and list(items[1].turn_index) == [2]
    stats = t.step([group], version=0)
    assert stats.applied and stats.n_trajectories == 2 and stats.n_samples == 4
    assert stats.n_tokens == 8  # (3 + 1) sampled tokens per episode; tool results and the helper are not trained
    assert stats.episodes == {
        "turns_per_episode": 3.0,
        "tool_calls_per_turn": pytest.approx(2 / 3),
        "invalid_call_rate": 0.5,
        "samples_per_episode": 3.0,
        "summaries_per_episode": 0.0,
        # PROMPT + 5 ids, PROMPT + 1, and the frozen helper's sample: every context token counted.
        "tokens_per_episode": 17.0,
    }
    # Behaviour log-probs were taken from this very model: no mismatch at any turn before the update.
    assert set(stats.mismatch_by_turn) == {"0", "1", "2"}
    assert all(abs(v) < 1e-4 for v in stats.mismatch_by_turn.values())
