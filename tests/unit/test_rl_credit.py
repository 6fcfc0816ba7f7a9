"""Episode credit: (group, agent) advantages, which tokens get them, and sample weights.

Hand-built episodes: a policy sample with a tool observation, a summary branch by the same
agent, and a frozen sub-agent; numbers are worked out in the comments.
"""

from __future__ import annotations

import pytest
import torch

from slipstream.rl import LossConfig, compute_loss, pack_batch, token_logprobs, turn_mismatch
from slipstream.rl.credit import (
    agent_advantages,
    episode_rows,
    group_rows,
    sample_weights,
    token_advantages,
    turn_indices,
)
from slipstream.schemas import Episode, PolicySegment, Sample, ScoredEpisode, Turn, pack_floats, pack_ids, pack_mask

pytestmark = pytest.mark.unit


def sample(sid: str, prompt: list[int], after: list[int], mask: list[int], **kw: object) -> Sample:
    return Sample(
        sample_id=sid,
        prompt_len=len(prompt),
        token_ids=pack_ids(prompt + after),
        logprobs=pack_floats([-0.5 if m else 0.0 for m in mask]),
        loss_mask=pack_mask(mask),
        segments=[PolicySegment(3, len(after))],
        **kw,  # type: ignore[arg-type]
    )


def chain_episode(eid: str = "e") -> Episode:
    """Policy turn (2 tokens), tool result (2, masked), policy turn (1); a summary branch; a frozen helper."""
    root = sample(f"{eid}/0", [1, 2], [10, 11, 90, 91, 12], [1, 1, 0, 0, 1])
    summary = sample(f"{eid}/1", [1, 2, 3], [20, 21], [1, 1], role="summary", branch_of=f"{eid}/0", branch_pos=5)
    helper = sample(f"{eid}/2", [7], [30, 31, 32], [1, 1, 1], agent_id="helper", role="subagent", trainable=False)
    return Episode(episode_id=eid, task_id="t", env="x", group_id="g", samples=[root, summary, helper])


def scored(ep: Episode, reward: float) -> ScoredEpisode:
    return ScoredEpisode(episode=ep, reward=reward)


def test_advantage_reaches_exactly_the_sampled_tokens_of_trainable_samples() -> None:
    adv = token_advantages(chain_episode(), 0.75)
    assert adv == [
        [0.75, 0.75, 0.0, 0.0, 0.75],  # the tool result (mask 0) gets nothing
        [0.75, 0.75],  # the summary is the policy's own work: same advantage
        [0.0, 0.0, 0.0],  # frozen sub-agent: nothing, although its mask is all 1
    ]
    with pytest.raises(KeyError, match="no advantage for agent 'policy'"):
        token_advantages(chain_episode(), {"other": 1.0})


def test_group_baseline_is_per_agent() -> None:
    # Rewards 1, 0, 0.5 -> policy mean 0.5 -> A = 0.5, -0.5, 0.
    # A second trainable agent "critic" appears only in episodes 0 and 2: its mean is (1 + 0.5)/2 = 0.75.
    eps = [chain_episode(f"e{i}") for i in range(3)]
    for i in (0, 2):
        eps[i].samples.append(sample(f"e{i}/c", [5], [6], [1], agent_id="critic"))
    advs = agent_advantages([scored(eps[0], 1.0), scored(eps[1], 0.0), scored(eps[2], 0.5)])
    assert advs == [{"policy": 0.5, "critic": 0.25}, {"policy": -0.5}, {"policy": 0.0, "critic": -0.25}]


def test_frozen_samples_produce_no_rows_and_weights_default_to_one() -> None:
    rows = episode_rows(chain_episode(), {"policy": 2.0})
    assert rows.sample_ids == ["e/0", "e/1"]
    assert [r.advantage for r in rows.items] == [2.0, 2.0]
    assert [r.loss_weight for r in rows.items] == [1.0, 1.0]
    assert sample_weights(chain_episode()) == {"e/0": 1.0, "e/1": 1.0}


def test_episode_weighting_sums_to_one_per_agent_and_keeps_producer_weights() -> None:
    ep = chain_episode()
    ep.samples[1].loss_weight = 0.5
    # Two trainable policy samples -> 1/2 each, times the producer's 0.5 on the summary.
    assert sample_weights(ep, "episode") == {"e/0": 0.5, "e/1": 0.25}
    with pytest.raises(ValueError, match="unknown sample weighting"):
        sample_weights(ep, "nope")  # type: ignore[arg-type]


def test_turn_indices_count_policy_runs_across_samples() -> None:
    ep = chain_episode()
    idx0, nxt = turn_indices(ep.samples[0])
    assert idx0 == [0, 0, -1, -1, 1] and nxt == 2
    idx1, nxt = turn_indices(ep.samples[1], nxt)
    assert idx1 == [2, 2] and nxt == 3
    # Listed turns win over mask runs: one policy Turn spanning positions 2..4 (two sampled tokens).
    s = sample("s", [1, 2], [10, 11], [1, 1], turns=[Turn(role="policy", start=2, end=4)])
    assert turn_indices(s, 5) == ([5, 5], 6)


def test_a_frozen_sample_between_policy_samples_does_not_renumber_the_policy_turns() -> None:
    root = sample("e/0", [1, 2], [10, 11, 90, 12], [1, 1, 0, 1])
    helper = sample("e/1", [1], [70, 0, 71, 0, 72], [1, 0, 1, 0, 1], agent_id="helper", trainable=False)
    last = sample("e/2", [1, 2], [13], [1])
    ep = Episode(episode_id="e", task_id="t", env="swarm", samples=[root, helper, last])
    rows = episode_rows(ep, {"policy": 1.0})
    assert rows.sample_ids == ["e/0", "e/2"]
    # The helper's three turns are not the policy's: the last sample holds the policy's third turn.
    assert [list(i.turn_index) for i in rows.items] == [[0, 0, -1, 1], [2]]


def test_cutting_an_episode_into_samples_does_not_change_the_loss() -> None:
    """Token weighting: the same sampled tokens, uncut or cut in two, give the same loss and gradient."""
    torch.manual_seed(0)
    vocab, logits_table = 16, torch.randn(16, 16)
    uncut = Episode(episode_id="u", task_id="t", env="x", samples=[sample("u/0", [1, 2], [3, 4, 5, 6], [1, 1, 1, 1])])
    # The cut version: first sample ends after [3, 4]; the second re-shows [1, 2, 3, 4] as its prompt.
    cut = Episode(
        episode_id="c",
        task_id="t",
        env="x",
        samples=[sample("c/0", [1, 2], [3, 4], [1, 1]), sample("c/1", [1, 2, 3, 4], [5, 6], [1, 1], branch_of="c/0")],
    )

    def loss_of(ep: Episode) -> tuple[float, torch.Tensor]:
        table = logits_table.clone().requires_grad_(True)
        batch = pack_batch(episode_rows(ep, {"policy": 1.5}).items)
        logits = table[batch.input_ids][:, :-1]
        lp = token_logprobs(logits, batch.targets)
        cfg = LossConfig(type="cispo")
        out = compute_loss(
            cfg, logprobs=lp, behaviour_logprobs=batch.behaviour_logprobs, advantages=batch.advantages, mask=batch.mask
        )
        out.loss.backward()
        assert table.grad is not None
        return float(out.loss.detach()), table.grad

    loss_u, grad_u = loss_of(uncut)
    loss_c, grad_c = loss_of(cut)
    assert vocab == 16 and loss_u == pytest.approx(loss_c, abs=1e-6)
    assert torch.allclose(grad_u, grad_c, atol=1e-6)
    # With "episode" weighting each of the two samples weighs 1/2: A·w = 1.5 · 0.5 on every sampled token.
    half = pack_batch(episode_rows(cut, {"policy": 1.5}, "episode").items)
    assert half.advantages[half.mask].tolist() == [0.75] * 4


def test_rows_carry_weight_into_the_advantage_tensor_and_turns_into_the_batch() -> None:
    ep = chain_episode()
    ep.samples[1].loss_weight = 0.5
    (g,) = [group_rows([scored(ep, 1.0), scored(chain_episode("f"), 0.0)])[0]]
    b = pack_batch(g.items)
    # Root: prompt 2 -> completion predicted at positions 1..5; summary: prompt 3 -> positions 2..3.
    assert b.advantages.tolist()[0] == [0.0, 0.5, 0.5, 0.5, 0.5, 0.5]
    assert b.advantages.tolist()[1][:4] == [0.0, 0.0, 0.25, 0.25]
    assert b.mask.tolist()[0] == [False, True, True, False, False, True]
    assert b.turn_index.tolist()[0] == [-1, 0, 0, -1, -1, 1]
    assert b.turn_index.tolist()[1][:4] == [-1, -1, 2, 2]


def test_turn_mismatch_sums_behaviour_minus_current_per_turn() -> None:
    behaviour = torch.tensor([[-0.5, -0.5, 0.0, -1.0]])
    current = torch.tensor([[-0.25, -0.75, -9.0, -0.5]])
    mask = torch.tensor([[True, True, False, True]])
    turns = torch.tensor([[0, 0, -1, 1]])
    got = turn_mismatch(current, behaviour, mask, turns)
    # turn 0: (-0.5 + 0.25) + (-0.5 + 0.75) = 0; turn 1: -1.0 + 0.5 = -0.5
    assert got == {0: (pytest.approx(0.0), 2), 1: (pytest.approx(-0.5), 1)}
