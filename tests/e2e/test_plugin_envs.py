"""Environments from outside libs/envs train on the real stack: the `sort` plugin package
(examples/plugin-env) and `reasoning_gym` (registered through libs/envs' own entry point).

For each, the five pipeline processes plus the eval-gate start with nothing but the env's name and
options in their config: every one of them finds the env through the `slipstream.environments`
entry points (a process that could not would never become ready). The learner takes STEPS steps
on scored rollouts. Every tapped rollout is then checked against the model that produced it:

- its prompt ids are [bos] + the tokenizer's encoding of the env's own prompt for that task (the
  task regenerated from its id: the env is reproducible by seed);
- its recorded completion ids are what that policy version sampled: teacher-forcing the ids
  through the version's weights gives back the behaviour log-probs the worker recorded, token
  for token (a retokenised or rewritten completion would not), and they decode to the text the
  reward model scored.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from e2e_support import one_version_rollouts, train_and_tap

from slipstream.engine.loading import load_pretrained
from slipstream.envs import get_env
from slipstream.rl.batch import token_logprobs
from slipstream.run.training import TrainingPlan, warm_start

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 3
ENVS = {
    "sort": {"length": 3, "alphabet": "abcdefgh"},
    "reasoning_gym": {"dataset": "spell_backward", "config": {"min_word_len": 3, "max_word_len": 3}},
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("env_name", sorted(ENVS))
async def test_an_env_from_a_plugin_trains_and_records_what_the_model_sampled(tmp_path: Path, env_name: str) -> None:
    torch.set_num_threads(1)
    plan = TrainingPlan(
        env=env_name,
        env_options=ENVS[env_name],
        sft_steps=150,  # enough for groups whose rewards differ, so the learner has steps to take
        max_steps=STEPS,
        groups_per_step=4,
        group_size=8,
        heldout_tasks=8,
        worker_tasks_in_flight=4,
        # Step 3 then trains only rollouts of version >= 1 (a v0 rollout would be 2 behind), so a
        # trained version's rollouts are always there to check; at the default 2 a quiet machine
        # sampled every task of the 3 steps under v0 before v1 landed (CI: {0: 104}).
        max_staleness=1,
    )
    run = f"plugin-{env_name.replace('_', '-')}"
    run_dir = tmp_path / run
    await asyncio.to_thread(warm_start, plan, run_dir / "model-init")
    tapped = await train_and_tap(plan, run_dir, run)

    the_env = get_env(env_name, **ENVS[env_name])
    _, tok = load_pretrained(run_dir / "model-init", dtype=torch.float32, device="cpu")
    checked: dict[int, int] = {}
    # single-turn: one sample, the prompt then the sampled answer
    async for ep, version, model in one_version_rollouts(tapped):
        (sample,) = ep.samples
        _, split, seed, index = ep.task_id.rsplit("-", 3)
        task = the_env.generate(split, int(index) + 1, int(seed))[int(index)]  # type: ignore[arg-type]
        ids, n = sample.ids(), sample.prompt_len
        assert ids[:n] == [tok.bos_id, *tok.encode(task.prompt)], ep.task_id
        mask, recorded = sample.mask(), sample.behaviour_logprobs()
        assert all(mask) and len(recorded) == len(ids) - n > 0
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[0]
        again = token_logprobs(logits[n - 1 : -1], torch.tensor(ids[n:]), temperature=plan.temperature)
        assert again.tolist() == pytest.approx(recorded, abs=2e-3), (ep.task_id, version)
        text = tok.decode([i for i in ids[n:] if i != tok.eos_id])
        assert text == ep.final_text, (ep.task_id, text, ep.final_text)
        checked[version] = checked.get(version, 0) + 1
    # The initial model's rollouts and at least one trained version's were checked.
    assert checked.get(0, 0) >= 8 and any(v > 0 for v in checked), checked
