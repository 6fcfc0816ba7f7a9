"""The `verifiers` environment: verifiers' own harness plays against Slipstream's engine.

A real TorchEngine (the tiny byte-level preset) is the policy; verifiers 0.4 runs in its own venv
(`.venv-vf`, `make verifiers-venv`) as the runner process, plays the repository's verifiers
tasksets (examples/verifiers-envs) with its `null` chat harness (a real program under uv), whose
training client renders prompts with `renderers` and calls the loopback
`/inference/v1/generate` route. Every episode must hold exactly the ids the client rendered
(the prompt: bos, then the chat template's text) and the ids the engine sampled for it, with the
engine's log-probs; the reward components are verifiers' rewards, recomputed here from the
task's rule on the recorded reply.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from slipstream.engine import SamplingParams, TorchEngine, build_tiny
from slipstream.engine.tokenizer import ByteTokenizer
from slipstream.envs import get_env
from slipstream.envs.registry import EnvError
from slipstream.envs.verifiers.bridge import Bridge
from slipstream.harness.provenance import RecordingEngine
from slipstream.harness.rollout import rollout_episodes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv-vf" / "bin" / "python"
TASKSETS = REPO / "examples" / "verifiers-envs"
TOK = ByteTokenizer()
HARNESS = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}

if not PYTHON.exists():
    pytest.skip(
        f"verifiers' venv {PYTHON} is not built (make verifiers-venv; CI skips: libs/envs README)",
        allow_module_level=True,
    )


def options(taskset: str, **more: Any) -> dict[str, Any]:
    return {
        "python": str(PYTHON),
        "pythonpath": [str(TASKSETS)],
        "env": {"taskset": {"id": taskset}, "agent": HARNESS},
        "tasks": 16,
        **more,
    }


@pytest.fixture
async def engine() -> AsyncIterator[RecordingEngine]:
    torch.set_num_threads(1)
    model, _ = build_tiny("tiny", seed=0)
    eng = RecordingEngine(TorchEngine(model, TOK, max_batch=8, max_seq_len=1024, device="cpu"))
    await eng.start()
    try:
        yield eng
    finally:
        await Bridge.close_all()
        await eng.stop()


def sum_task(index: int) -> tuple[str, str]:
    rng = random.Random(f"vf_sum-{index}")
    a, b = rng.randrange(10), rng.randrange(10)
    return f"{a}+{b}=", str(a + b)


async def test_single_turn_episodes_hold_what_the_client_rendered_and_the_engine_sampled(
    engine: RecordingEngine,
) -> None:
    env = get_env("verifiers", **options("vf_sum", sampling={"max_tokens": 4}))
    params = SamplingParams(max_tokens=8, temperature=1.0)
    episodes = []
    for task in env.generate("train", 2, seed=0):
        episodes += await rollout_episodes(engine, TOK, env, task, group_size=3, params=params)
    assert len(episodes) == 6
    by_id = {c.request_id: c for c in engine.calls}
    for ep in episodes:
        (sample,) = ep.samples
        question, answer = sum_task(int(ep.metadata["key"].removeprefix("task-")))
        ids, n = sample.ids(), sample.prompt_len
        assert ids[:n] == [TOK.bos_id, *TOK.encode(f"user: {question}\nassistant: ")], ep.episode_id
        (call,) = [c for rid, c in by_id.items() if rid.startswith(sample.sample_id)]
        assert list(call.prompt_ids) == ids[:n]
        assert ids[n:] == list(call.completion_ids) and sample.mask() == [1] * len(call.completion_ids)
        assert sample.behaviour_logprobs() == list(call.logprobs)
        reply = ep.final_text  # the reply as verifiers read it: its renderer parsed the sampled ids
        assert reply.strip() == TOK.decode([t for t in call.completion_ids if t != TOK.eos_id]).strip()
        exact = 1.0 if reply.strip() == answer else 0.0
        close = 0.5 * (1.0 - abs(ord(reply[0]) - ord(answer[0])) / 256) if reply else 0.0
        score = env.score(env.generate("train", 2, seed=0)[int(ep.task_id.rsplit("-", 1)[1])], ep)
        assert score.components == pytest.approx({"vf.exact": exact, "vf.close": close}), (ep.episode_id, reply)
        assert score.correct == (exact + close >= 1.0)


def test_bad_options_fail_before_anything_starts() -> None:
    with pytest.raises(EnvError, match="taskset id"):
        get_env("verifiers", python=str(PYTHON), env={})
    with pytest.raises(EnvError, match="does not exist"):
        get_env("verifiers", python="/no/such/python", env={"taskset": {"id": "vf_sum"}})
    with pytest.raises(EnvError, match="unknown option"):
        get_env("verifiers", python=str(PYTHON), env={"taskset": {"id": "vf_sum"}}, harness="null")


def lookup_value(key: str) -> str:
    return str(random.Random(f"vf_lookup-{key}").randrange(100))


def tool_user(request: Any, prompt: str) -> str:
    """A scripted policy: call `lookup` for the asked key, then answer with what the tool said."""
    if "\ntool: " in prompt:
        return prompt.rsplit("\ntool: ", 1)[1].split("\n", 1)[0]
    key = prompt.rsplit("What is stored under ", 1)[1].split("?", 1)[0]
    return '<tool_call>{"name": "lookup", "arguments": {"key": "' + key + '"}}</tool_call>'


async def test_multi_turn_tool_episode_is_one_sample_with_the_tool_result_at_mask_0() -> None:
    """A random tiny model never writes a tool call, so a scripted policy (the harness's
    ScriptedEngine: ids through the same tokenizer) plays; everything else is real: verifiers'
    harness, its MCP tool server, its renderer and the route."""
    from slipstream.supervised.scripted import ScriptedEngine

    engine = RecordingEngine(ScriptedEngine(TOK, tool_user))
    await engine.start()
    env = get_env("verifiers", **options("vf_lookup", renderer={"tool_parser": "slipstream-tags"}))
    try:
        task = env.generate("train", 1, seed=0)[0]
        (ep,) = await rollout_episodes(engine, TOK, env, task, group_size=1, params=SamplingParams(max_tokens=96))
    finally:
        await Bridge.close_all()
        await engine.stop()
    index = int(ep.metadata["key"].removeprefix("task-"))
    key = random.Random(f"vf_lookup-task-{index}").choice([f"k{i}" for i in range(10)])
    value = lookup_value(key)
    (sample,) = ep.samples  # the second prompt extended the first: one sample, not two
    calls = sorted(engine.calls, key=lambda c: len(c.prompt_ids))
    assert len(calls) == 2
    ids, n, mask = sample.ids(), sample.prompt_len, sample.mask()
    first, second = calls
    assert ids[:n] == list(first.prompt_ids)
    assert ids[n : n + len(first.completion_ids)] == list(first.completion_ids)
    observed = ids[n + len(first.completion_ids) : len(second.prompt_ids)]
    assert list(second.prompt_ids) == ids[: len(second.prompt_ids)]
    assert ids[len(second.prompt_ids) :] == list(second.completion_ids)
    assert mask == [1] * len(first.completion_ids) + [0] * len(observed) + [1] * len(second.completion_ids)
    assert TOK.decode(observed) == f"\ntool: {value}\nassistant: "  # the tool's answer, rendered by verifiers
    assert ep.final_text == value
    score = env.score(task, ep)
    assert score.components == {"vf.exact": 1.0, "vf.looked_up": 0.25}
    assert score.correct


def test_the_scorer_version_names_the_options() -> None:
    """The reward model labels scores with it; the options have no valid default to compare with."""
    one = get_env("verifiers", **options("vf_sum"))
    two = get_env("verifiers", **options("vf_lookup"))
    assert one.scorer_version.startswith("verifiers@1+") and one.scorer_version != two.scorer_version
    assert one.scorer_version == get_env("verifiers", **options("vf_sum")).scorer_version
