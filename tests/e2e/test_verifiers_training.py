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

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import nats
import pytest
import torch
from e2e_support import until

from slipstream.cli.spec import StackSpec, StoreSpec
from slipstream.cli.stack import Stack
from slipstream.cli.training import PIPELINE, TrainingPlan, service_env
from slipstream.engine import build_tiny, save_pretrained
from slipstream.engine.loading import load_pretrained
from slipstream.learner.outcomes import read_outcomes
from slipstream.rl.batch import token_logprobs
from slipstream.schemas import SCHEMA_HEADER, Episode, decode_message
from slipstream.store import LocalObjectStore
from slipstream.weights import manifest_key
from slipstream.weights.chain import load_version

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
    pytest.skip(f"verifiers' venv {PYTHON} is not built (make verifiers-venv)", allow_module_level=True)


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
    model_dir, store_root = run_dir / "model-init", run_dir / "data" / "store"
    outcomes = run_dir / "learner-outcomes.jsonl"
    # No warm-start: a verifiers task's prompt and answer live on the verifiers side, and the
    # shaped `close` reward already gives a random model's groups different rewards.
    model, tokenizer = build_tiny(plan.preset, seed=plan.seed)
    save_pretrained(model, tokenizer, model_dir)
    env = service_env(plan, model_dir, run_dir / "staging", outcomes)
    env["SLIPSTREAM_GATE__ENVS"] = json.dumps(["verifiers"])
    env["SLIPSTREAM_WORKER__RECOMPUTE_KV_ON_UPDATE"] = "true"
    spec = StackSpec(
        run_dir=run_dir,
        services=(*PIPELINE, "eval-gate"),
        store=StoreSpec(type="local", root=str(store_root)),
        run_id=run,
        env=env,
        ready_timeout_s=240.0,
        drain_timeout_s=10.0,
    )
    stack = Stack(spec)
    episodes: list[Episode] = []
    tap = None
    try:
        await asyncio.to_thread(stack.start)
        tap = await nats.connect(stack.servers["nats"].url, **stack.admin_nats_options())

        async def on_traj(msg: Any) -> None:
            episodes.append(decode_message(msg.data, (msg.headers or {}).get(SCHEMA_HEADER), Episode))

        await tap.subscribe("traj.raw.>", cb=on_traj)
        await asyncio.to_thread(stack.wait_ready)
        learner = stack.services["learner"]
        await until(lambda: not learner.alive(), 420, f"the learner's {STEPS} steps")
        assert learner.returncode == 0, stack.tail("learner")
        store = LocalObjectStore(store_root)
        await until(lambda: store.exists(manifest_key(run, STEPS)), 60, f"version {STEPS} stored")
    finally:
        if tap is not None:
            await tap.close()
        await asyncio.to_thread(stack.stop)

    trained = [o for o in read_outcomes(outcomes) if o.outcome == "trained"]
    assert trained and max(o.step for o in trained) == STEPS
    assert episodes and {e.env for e in episodes} == {"verifiers"}
    assert {o.trajectory_id for o in trained} <= {e.episode_id for e in episodes}

    model, tok = load_pretrained(model_dir, dtype=torch.float32, device="cpu")
    model.eval()
    weights: dict[int, dict[str, torch.Tensor]] = {}
    checked: dict[int, int] = {}
    for ep in episodes:
        (sample,) = ep.samples
        versions = set(sample.versions())
        assert set(ep.metadata) >= {"reward.vf.exact", "reward.vf.close"}, ep.metadata
        if len(versions) != 1:
            continue
        (version,) = versions
        if version not in weights:
            weights[version] = (
                load_pretrained(model_dir, dtype=torch.float32, device="cpu")[0].state_dict()
                if version == 0
                else await asyncio.to_thread(load_version, store, run, version)
            )
        model.load_state_dict(weights[version], strict=False)
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
