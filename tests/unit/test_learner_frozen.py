"""Frozen means frozen: a sub-agent's tokens never reach the learner's gradient (issue 15).

A swarm episode records the frozen sub-agents' samples next to the orchestrator's
(`trainable=False`, `role="subagent"`), for audit and metrics. Through the learner's real path
(`Intake.offer`/`take`, `Trainer.step` on the tiny model, CPU), the gradient of a group of such
episodes must be bit-identical whatever those samples hold (token ids, even outside the policy's
vocabulary, log-probs, lengths, turns), while a change to the orchestrator's own tokens must
change it (the control that shows the comparison can fail).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from slipstream.engine import build_tiny
from slipstream.learner.config import LearnerSection
from slipstream.learner.intake import Intake
from slipstream.learner.ledger import TrainedLedger
from slipstream.learner.trainer import StepStats, Trainer
from slipstream.rl import LossConfig
from slipstream.schemas import Episode, PolicySegment, Sample, ScoredEpisode, pack_floats, pack_ids, pack_mask

pytestmark = pytest.mark.unit

PROMPT = [1, 40, 41, 42]
# Orchestrator: a turn that assigns work, the sub-agents' replies (observations), a final turn.
ORCH = ([60, 61, 90, 91, 92, 62], [1, 1, 0, 0, 0, 1])
ORCH_FINAL = ([63, 64], [1, 1])


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def sample(sid: str, prompt: list[int], completion: list[int], mask: list[int], **fields: object) -> Sample:
    lp = [-1.5 - 0.1 * k if m else 0.0 for k, m in enumerate(mask)]
    return Sample(
        sample_id=sid,
        prompt_len=len(prompt),
        token_ids=pack_ids(prompt + completion),
        logprobs=pack_floats(lp),
        loss_mask=pack_mask(mask),
        segments=[PolicySegment(0, len(completion))],
        **fields,  # type: ignore[arg-type]
    )


def subagent(sid: str, agent: str, prompt: list[int], completion: list[int], mask: list[int], lp: float) -> Sample:
    s = sample(sid, prompt, completion, mask, agent_id=agent, role="subagent", trainable=False)
    s.logprobs = pack_floats([lp if m else 0.0 for m in mask])
    return s


def episode(eid: str, reward: float, subs: list[Sample], orch: tuple[list[int], list[int]] = ORCH) -> ScoredEpisode:
    """Orchestrator sample, the sub-agents' samples, then the orchestrator's final sample (a context restart)."""
    first = sample(f"{eid}/main/0", PROMPT, orch[0], orch[1])
    final = sample(f"{eid}/main/1", PROMPT, *ORCH_FINAL)
    for s in subs:
        s.sample_id = f"{eid}/{s.sample_id}"
    ep = Episode(episode_id=eid, task_id="t", env="swarm", group_id="t/g", group_size=2, samples=[first, *subs, final])
    return ScoredEpisode(episode=ep, reward=reward, components={"perf": reward}, correct=reward > 0.5)


def small_subs() -> list[Sample]:
    return [
        subagent("sub-1/0", "sub-1", [1, 70], [71, 72, 73], [1, 1, 1], -0.7),
        subagent("sub-2/0", "sub-2", [1, 80, 81], [82, 83], [1, 1], -2.0),
    ]


def other_subs() -> list[Sample]:
    """Other ids (some outside the policy's 259-token vocabulary), log-probs, prompt and lengths, more turns."""
    return [
        subagent("sub-1/0", "sub-1", [1, 9000, 5, 6], [9001, 120, 0, 0, 121, 9002, 9003], [1, 1, 0, 0, 1, 1, 1], -9.0),
        subagent("sub-1/1", "sub-1", [1, 70], [200], [1], 3.0),
        subagent("sub-2/0", "sub-2", [1], [30, 31, 32, 33, 34, 35, 36, 37, 38], [1] * 9, -0.01),
        subagent("sub-3/0", "sub-3", [1, 2, 3, 4, 5], [250, 251], [1, 0], -4.0),
    ]


def gradient(group: list[ScoredEpisode], loss_type: str) -> tuple[dict[str, torch.Tensor], StepStats]:
    """The learner's gradient for one group, taken where AdamW would apply it (after the clip)."""
    intake: Intake[str] = Intake(max_staleness=0, group_timeout_s=10.0, vocab_size=259, ledger=TrainedLedger(3))
    for s in group:
        assert intake.offer(s, s.episode.episode_id, version=0, now=0.0) == []
    (taken,), drops = intake.take(1, version=0)
    assert drops == []
    model, tok = build_tiny("tiny", seed=7)
    section = LearnerSection(micro_batch=2)
    t = Trainer(model, section, LossConfig(type=loss_type), pad_id=tok.pad_id)
    grads: dict[str, torch.Tensor] = {}

    def capture() -> None:
        grads.update({n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None})

    t.optimizer.step = capture  # type: ignore[method-assign]
    stats = t.step([[m.scored for m in taken.members]], version=0)
    assert stats.applied and grads
    return grads, stats


@pytest.mark.parametrize("loss_type", ["grpo", "cispo"])
def test_changing_the_sub_agents_tokens_leaves_the_gradient_bit_identical(loss_type: str) -> None:
    base, base_stats = gradient([episode("a", 1.0, small_subs()), episode("b", 0.0, small_subs())], loss_type)
    swapped, stats = gradient([episode("a", 1.0, other_subs()), episode("b", 0.0, [])], loss_type)
    assert swapped.keys() == base.keys()
    assert all(torch.equal(swapped[name], g) for name, g in base.items())
    # The whole trained side of the step is the same: rows, tokens, loss, per-turn mismatch.
    assert (stats.n_samples, stats.n_tokens, stats.loss, stats.grad_norm) == (
        base_stats.n_samples,
        base_stats.n_tokens,
        base_stats.loss,
        base_stats.grad_norm,
    )
    assert stats.mismatch_by_turn == base_stats.mismatch_by_turn and stats.figures == base_stats.figures
    assert (base_stats.n_samples, base_stats.n_tokens) == (4, 2 * (3 + 2))  # orchestrator rows only
    assert stats.episodes["tokens_per_episode"] != base_stats.episodes["tokens_per_episode"]  # they did change


@pytest.mark.parametrize("loss_type", ["grpo", "cispo"])
def test_changing_the_orchestrators_tokens_changes_the_gradient(loss_type: str) -> None:
    base, _ = gradient([episode("a", 1.0, small_subs()), episode("b", 0.0, small_subs())], loss_type)
    moved = ([60, 65, 90, 91, 92, 62], ORCH[1])  # one sampled token of the orchestrator's first turn
    changed, _ = gradient([episode("a", 1.0, small_subs(), moved), episode("b", 0.0, small_subs())], loss_type)
    assert changed.keys() == base.keys()
    differ = [name for name, g in base.items() if not torch.equal(changed[name], g)]
    assert "model.embed_tokens.weight" in differ or "lm_head.weight" in differ
