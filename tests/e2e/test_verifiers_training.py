"""A verifiers environment trains on the real stack: `[env] name = "verifiers"` with the
repository's `vf_sum` taskset, played by verifiers' own `null` harness (its venv, `.venv-vf`).

The five pipeline processes plus the eval-gate start with the env's name and options only; the
worker's episodes are played by verifiers' harness, whose training client renders the prompt
and samples through the worker's loopback `/inference/v1/generate` route. The learner takes
STEPS steps on the rewards verifiers computed (components `vf.exact`, `vf.close`). Every tapped
rollout is then checked against the model that produced it: its prompt ids are what verifiers'
renderer rendered for the task (bos, then the chat template's text); teacher-forcing its ids
through that version's weights gives back the behaviour log-probs the worker recorded, token for
token; and its reply is what verifiers scored.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from e2e_support import one_version_rollouts, train_and_tap

from slipstream.engine import build_tiny, save_pretrained
from slipstream.rl.batch import token_logprobs
from slipstream.run.training import TrainingPlan

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv-vf" / "bin" / "python"
STEPS = 3  # step 3 trains only rollouts of version >= 1 (max_staleness 1): a trained version is checked too
OPTIONS = {
    "python": str(PYTHON),
    "pythonpath": [str(REPO / "examples" / "verifiers-envs")],
    "env": {"taskset": {"id": "vf_sum"}, "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}},
    "tasks": 64,
    "sampling": {"max_tokens": 3},
}

if not PYTHON.exists():
    pytest.skip(
        f"verifiers' venv {PYTHON} is not built (make verifiers-venv; CI skips: libs/envs README)",
        allow_module_level=True,
    )


@pytest.mark.timeout(600)
async def test_a_verifiers_env_trains_and_records_what_the_model_sampled(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    plan = TrainingPlan(
        env="verifiers",
        env_options=OPTIONS,
        max_steps=STEPS,
        groups_per_step=2,
        group_size=4,
        heldout_tasks=4,
        heldout_samples=1,
        worker_tasks_in_flight=4,
        max_tokens=3,
        max_staleness=1,
    )
    run = "vf-sum"
    run_dir = tmp_path / run
    # No warm-start: a verifiers task's prompt and answer live on the verifiers side, and the
    # shaped `close` reward already gives a random model's groups different rewards.
    model, tokenizer = build_tiny(plan.preset, seed=plan.seed)
    save_pretrained(model, tokenizer, run_dir / "model-init")
    tapped = await train_and_tap(plan, run_dir, run)

    tok = tokenizer
    checked: dict[int, int] = {}
    async for ep, version, model in one_version_rollouts(tapped):
        (sample,) = ep.samples
        assert set(ep.metadata) >= {"reward.vf.exact", "reward.vf.close"}, ep.metadata
        rng = random.Random(f"vf_sum-{int(ep.metadata['key'].removeprefix('task-'))}")
        a, b = rng.randrange(10), rng.randrange(10)
        ids, n = sample.ids(), sample.prompt_len
        assert ids[:n] == [tok.bos_id, *tok.encode(f"user: {a}+{b}=\nassistant: ")], ep.task_id
        mask, recorded = sample.mask(), sample.behaviour_logprobs()
        assert all(mask) and len(recorded) == len(ids) - n > 0
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[0]
        again = token_logprobs(logits[n - 1 : -1], torch.tensor(ids[n:]), temperature=plan.temperature)
        assert again.tolist() == pytest.approx(recorded, abs=2e-3), (ep.task_id, version)
        text = tok.decode([i for i in ids[n:] if i != tok.eos_id])
        assert text.strip() == ep.final_text.strip(), (ep.task_id, text, ep.final_text)
        checked[version] = checked.get(version, 0) + 1
    assert checked.get(0, 0) >= 4 and any(v > 0 for v in checked), checked
