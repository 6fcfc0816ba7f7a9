"""A multi-turn, tool-using verifiers environment trains on the real stack: `[env] name =
"verifiers"` with the repository's `vf_lookup` taskset (a `lookup` tool served over MCP by
verifiers), played by verifiers' own `null` harness in its venv (`.venv-vf`).

A random model never writes a tool call, so the micro model is first warm-started on expert
episodes played through the same verifiers path in this process (a scripted policy behind the
loopback route: call `lookup` for the asked key, then answer with what the tool said); the rows
are the ids verifiers' renderer rendered and the ids the policy sampled, so the warm-started
model writes `<tool_call>` tags the harness's parser reads. Then the five pipeline processes plus
the eval-gate start with the env's name and options only, and the learner takes STEPS steps on
verifiers' rewards (`vf.exact`, `vf.looked_up`).

Every tapped rollout is checked against the model that produced it: its prompt is what verifiers
rendered for the task (the tool's schema, then the question), each tool result verifiers
rendered back is a mask-0 span of the one sample, and teacher-forcing its ids through that
version's weights gives back, at every sampled position, the behaviour log-prob the worker
recorded. Rollouts that called the tool must be among them: the multi-turn path itself ran.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from e2e_support import TappedRun, one_version_rollouts, train_and_tap

from slipstream.engine import SamplingParams, build_tiny, save_pretrained
from slipstream.engine.loading import load_pretrained
from slipstream.engine.tokenizer import ByteTokenizer
from slipstream.envs import get_env
from slipstream.envs.verifiers.bridge import Bridge
from slipstream.harness.rollout import rollout_episodes
from slipstream.rl.batch import token_logprobs
from slipstream.run.training import TrainingPlan
from slipstream.supervised.expert import Example, episode_examples
from slipstream.supervised.scripted import ScriptedEngine
from slipstream.supervised.warmstart import sft_warmstart

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv-vf" / "bin" / "python"
STEPS = 3  # step 3 trains only rollouts of version >= 1 (max_staleness 1): a trained version is checked too
MAX_TOKENS = 80  # a call `<tool_call>{"name": "lookup", "arguments": {"key": "k3"}}</tool_call>` is 69 bytes, then eos
OPTIONS: dict[str, Any] = {
    "python": str(PYTHON),
    "pythonpath": [str(REPO / "examples" / "verifiers-envs")],
    "env": {"taskset": {"id": "vf_lookup"}, "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}},
    "tasks": 64,
    "renderer": {"tool_parser": "slipstream-tags"},
    "sampling": {"max_tokens": MAX_TOKENS},
}
EXPERT_TASKS = 8  # rows cycled through the warm-start; each expert episode costs a harness run (~2 s of a core)
SFT_STEPS = 150

if not PYTHON.exists():
    pytest.skip(
        f"verifiers' venv {PYTHON} is not built (make verifiers-venv; CI skips: libs/envs README)",
        allow_module_level=True,
    )


def expert(request: Any, prompt: str) -> str:
    """Call `lookup` for the asked key; once the tool answered, reply with its answer."""
    if "\ntool: " in prompt:
        return prompt.rsplit("\ntool: ", 1)[1].split("\n", 1)[0]
    key = prompt.rsplit("What is stored under ", 1)[1].split("?", 1)[0]
    return '<tool_call>{"name": "lookup", "arguments": {"key": "' + key + '"}}</tool_call>'


async def expert_rows() -> list[Example]:
    """The expert's episodes through the verifiers path, as warm-start rows (loss on its own ids)."""
    tok = ByteTokenizer()
    env = get_env("verifiers", **OPTIONS)
    engine = ScriptedEngine(tok, expert)
    await engine.start()
    params = SamplingParams(max_tokens=MAX_TOKENS)
    try:
        played = await asyncio.gather(
            *(
                rollout_episodes(engine, tok, env, t, group_size=1, params=params)
                for t in env.generate("train", EXPERT_TASKS, seed=0)
            )
        )
    finally:
        await Bridge.close_all()
        await engine.stop()
    rows = [row for episodes in played for ep in episodes for row in episode_examples(ep)]
    # Every expert episode called the tool and answered right: two turns, one sample.
    assert len(rows) == EXPERT_TASKS, len(rows)
    assert all(float(ep.metadata["reward.vf.exact"]) == 1.0 for episodes in played for ep in episodes)
    return rows


def lookup_plan() -> TrainingPlan:
    return TrainingPlan(
        env="verifiers",
        env_options=OPTIONS,
        preset="micro",
        max_steps=STEPS,
        groups_per_step=2,
        group_size=4,
        heldout_tasks=4,
        heldout_samples=1,
        worker_tasks_in_flight=4,
        max_tokens=MAX_TOKENS,
        max_staleness=1,
        temperature=1.0,
    )


@pytest.mark.timeout(1800)
async def test_a_tool_using_verifiers_env_trains_and_records_what_the_model_sampled(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    plan = lookup_plan()
    run = "vf-lookup"
    run_dir = tmp_path / run
    rows = await expert_rows()
    model, tok = build_tiny(plan.preset, seed=plan.seed)
    env = get_env("verifiers", **OPTIONS)
    figures = await asyncio.to_thread(
        sft_warmstart, model, tok, env, steps=SFT_STEPS, batch_size=16, lr=3e-3, seed=plan.seed, rows=rows
    )
    print(f"warm-start: {figures['steps']} steps, loss {figures['loss_first']:.3f} -> {figures['loss_last']:.3f}")
    assert figures["loss_last"] < figures["loss_first"] / 4, figures
    save_pretrained(model, tok, run_dir / "model-init")
    # Each episode starts a chat program and an MCP server (~2 s of a core): on 2 shared cores the
    # three steps took 7-9 minutes at load 8-10, past the 420 s other envs' runs are given.
    tapped = await train_and_tap(plan, run_dir, run, steps_timeout_s=1200.0)

    checked, with_tool = await check_rollouts(tapped, plan.temperature)
    assert checked.get(0, 0) >= 4 and any(v > 0 for v in checked), checked
    assert with_tool > 0, "no rollout called the tool: the multi-turn path did not run"


async def check_rollouts(tapped: TappedRun, temperature: float) -> tuple[dict[int, int], int]:
    """Check every one-version rollout (module docstring): (rollouts checked per version, how many called the tool)."""
    _, tok = load_pretrained(tapped.model_dir, dtype=torch.float32, device="cpu")
    checked: dict[int, int] = {}
    with_tool = 0
    async for ep, version, model in one_version_rollouts(tapped):
        (sample,) = ep.samples  # the turns after a tool result extend the first prompt: one sample
        assert {"reward.vf.exact", "reward.vf.looked_up"} <= set(ep.metadata), ep.metadata
        index = int(ep.metadata["key"].removeprefix("task-"))
        key = random.Random(f"vf_lookup-task-{index}").choice([f"k{i}" for i in range(10)])
        ids, n, mask, recorded = sample.ids(), sample.prompt_len, sample.mask(), sample.behaviour_logprobs()
        prompt = tok.decode(ids[1:n])
        assert ids[0] == tok.bos_id and prompt.startswith("tools: ") and "lookup" in prompt.split("\n", 1)[0]
        assert prompt.endswith(f"\nuser: What is stored under {key}?\nassistant: "), (ep.task_id, prompt)
        observed = [t for t in sample.turns if t.role != "policy"]
        for turn in observed:
            assert mask[turn.start - n : turn.end - n] == [0] * (turn.end - turn.start)
            assert "\ntool: " in tok.decode(ids[turn.start : turn.end]), tok.decode(ids[turn.start : turn.end])
        with_tool += bool(observed)
        assert (float(ep.metadata["reward.vf.looked_up"]) > 0) == bool(observed), (ep.task_id, ep.metadata)
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[0]
        again = token_logprobs(logits[n - 1 : -1], torch.tensor(ids[n:]), temperature=temperature).tolist()
        sampled = [i for i, m in enumerate(mask) if m]
        assert sampled and [again[i] for i in sampled] == pytest.approx([recorded[i] for i in sampled], abs=2e-3)
        checked[version] = checked.get(version, 0) + 1
    return checked, with_tool
