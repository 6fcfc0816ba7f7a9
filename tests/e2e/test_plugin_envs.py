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
import json
from pathlib import Path
from typing import Any

import nats
import pytest
import torch
from e2e_support import until

from slipstream.cli.spec import StackSpec, StoreSpec
from slipstream.cli.stack import Stack
from slipstream.cli.training import PIPELINE, TrainingPlan, service_env, warm_start
from slipstream.engine.loading import load_pretrained
from slipstream.envs import get_env
from slipstream.learner.outcomes import read_outcomes
from slipstream.rl.batch import token_logprobs
from slipstream.schemas import SCHEMA_HEADER, Episode, decode_message
from slipstream.store import LocalObjectStore
from slipstream.weights import manifest_key
from slipstream.weights.chain import load_version

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
    model_dir, store_root = run_dir / "model-init", run_dir / "data" / "store"
    outcomes = run_dir / "learner-outcomes.jsonl"
    await asyncio.to_thread(warm_start, plan, model_dir)
    env = service_env(plan, model_dir, run_dir / "staging", outcomes)
    env["SLIPSTREAM_GATE__ENVS"] = json.dumps([env_name])
    # The engine keeps a row's KV cache across a weight update by default (libs/engine README): a row
    # prefilled under v1 and sampled under v2 is then neither version's alone. Re-prefilled, every
    # token of a one-version sample is that version's work, so teacher-forcing it must agree exactly.
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
        await asyncio.to_thread(stack.wait_ready)  # the worker, reward model and eval-gate built the env by name
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
    assert episodes and {e.env for e in episodes} == {env_name}
    assert {o.trajectory_id for o in trained} <= {e.episode_id for e in episodes}  # trained on what the tap saw

    the_env = get_env(env_name, **ENVS[env_name])
    model, tok = load_pretrained(model_dir, dtype=torch.float32, device="cpu")
    model.eval()
    weights: dict[int, dict[str, torch.Tensor]] = {}
    checked: dict[int, int] = {}
    for ep in episodes:
        (sample,) = ep.samples  # single-turn: one sample, the prompt then the sampled answer
        versions = set(sample.versions())
        if len(versions) != 1:
            continue  # a weight update landed inside it; its two parts are two models' work
        (version,) = versions
        if version not in weights:
            weights[version] = (
                load_pretrained(model_dir, dtype=torch.float32, device="cpu")[0].state_dict()
                if version == 0
                else await asyncio.to_thread(load_version, store, run, version)
            )
        model.load_state_dict(weights[version], strict=False)
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
