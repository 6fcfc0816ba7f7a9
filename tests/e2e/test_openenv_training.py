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

STEPS = 3  # step 3 trains only rollouts of version >= 1 (max_staleness 1): a trained version is checked too
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
    model_dir, store_root = run_dir / "model-init", run_dir / "data" / "store"
    outcomes = run_dir / "learner-outcomes.jsonl"
    # No warm-start: the task's prompt is the server's; the server's shaped `near` reward already
    # gives a random model's groups different rewards.
    model, tokenizer = build_tiny(plan.preset, seed=plan.seed)
    save_pretrained(model, tokenizer, model_dir)
    env = service_env(plan, model_dir, run_dir / "staging", outcomes)
    env["SLIPSTREAM_GATE__ENVS"] = json.dumps(["openenv"])
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
    assert episodes and {e.env for e in episodes} == {"openenv"}
    assert {o.trajectory_id for o in trained} <= {e.episode_id for e in episodes}

    model, tok = load_pretrained(model_dir, dtype=torch.float32, device="cpu")
    model.eval()
    weights: dict[int, dict[str, torch.Tensor]] = {}
    checked: dict[int, int] = {}
    for ep in episodes:
        (sample,) = ep.samples
        assert "reward.env" in ep.metadata, ep.metadata
        versions = set(sample.versions())
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
