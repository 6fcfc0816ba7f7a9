"""An OpenEnv environment trains on the real stack: `[env] name = "openenv"` against the `guess`
server (examples/openenv-guess, openenv-core's own server code) started here on a free port.

The five pipeline processes plus the eval-gate start with the env's name and options only; the
worker and the eval-gate play their episodes over WebSocket sessions with the server, whose
rewards (summed, component `env`) are what the learner trains on for STEPS steps. Every tapped
rollout is then checked against the model that produced it: its prompt ids are [bos] + the
server's first observation, its observation spans (mask 0) the server's later texts, and
teacher-forcing its ids through that version's weights gives back, at every sampled position,
the behaviour log-prob the worker recorded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from e2e_support import one_version_rollouts, train_and_tap

from slipstream.engine import build_tiny, save_pretrained
from slipstream.rl.batch import token_logprobs
from slipstream.run.training import TrainingPlan

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 4  # steps 3-4 train only rollouts of version >= 1 (max_staleness 1): a trained version is checked too
# (at 3 steps a fresh-clone CI run under load once tapped no rollout sampled wholly at one version >= 1:
# every such rollout had a weight update land inside it, which the check skips)
FIRST = "Guess the hidden letter, one of abcdefgh. Answer with one letter.\nGuess: "


@pytest.mark.timeout(600)
async def test_an_openenv_env_trains_and_records_what_the_model_sampled(
    tmp_path: Path, openenv_guess_server: str
) -> None:
    torch.set_num_threads(1)
    url = openenv_guess_server
    options = {"base_url": url, "max_turns": 2, "max_answer_chars": 3}
    plan = TrainingPlan(
        env="openenv",
        env_options=options,
        max_steps=STEPS,
        groups_per_step=2,
        group_size=4,
        heldout_tasks=4,
        heldout_samples=1,
        worker_tasks_in_flight=4,
        max_tokens=3,
        max_staleness=1,
    )
    run = "openenv-guess"
    run_dir = tmp_path / run
    # No warm-start: the task's prompt is the server's; the server's shaped `near` reward already
    # gives a random model's groups different rewards.
    model, tokenizer = build_tiny(plan.preset, seed=plan.seed)
    save_pretrained(model, tokenizer, run_dir / "model-init")
    tapped = await train_and_tap(plan, run_dir, run)

    tok = tokenizer
    checked: dict[int, int] = {}
    async for ep, version, model in one_version_rollouts(tapped):
        (sample,) = ep.samples
        assert "reward.env" in ep.metadata, ep.metadata
        ids, n, mask, recorded = sample.ids(), sample.prompt_len, sample.mask(), sample.behaviour_logprobs()
        assert ids[:n] == [tok.bos_id, *tok.encode(FIRST)], ep.task_id
        for turn in sample.turns:
            if turn.role != "policy":
                assert ids[turn.start : turn.end] == tok.encode(turn.text) and turn.text.startswith("\nNo: ")
                assert mask[turn.start - n : turn.end - n] == [0] * (turn.end - turn.start)
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[0]
        again = token_logprobs(logits[n - 1 : -1], torch.tensor(ids[n:]), temperature=plan.temperature).tolist()
        sampled = [i for i, m in enumerate(mask) if m]
        assert sampled and [again[i] for i in sampled] == pytest.approx([recorded[i] for i in sampled], abs=2e-3)
        checked[version] = checked.get(version, 0) + 1
    assert checked.get(0, 0) >= 4 and any(v > 0 for v in checked), checked
