"""The rollout worker's task screen (screen.py): its chance formulas, its draw, and that its pass
chance p is exactly the probability the engine gives the reference when it samples it."""

from __future__ import annotations

import math

import msgspec
import pytest

from slipstream.engine import ByteTokenizer, SamplingParams, TorchEngine, build_tiny
from slipstream.envs import get_env
from slipstream.harness import rollout_episodes
from slipstream.rollout_worker.screen import TaskScreen, draw, informative_chance, keep_chance

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

TOK = ByteTokenizer()


def test_informative_chance_by_hand() -> None:
    assert informative_chance(0.0, 8) == 0.0
    assert informative_chance(1.0, 8) == 0.0
    assert informative_chance(0.5, 2) == pytest.approx(0.5)
    assert informative_chance(0.1, 8) == pytest.approx(1 - 0.1**8 - 0.9**8)
    assert informative_chance(0.1, 16) > informative_chance(0.1, 8)


def test_keep_chance_caps_at_one_and_refuses_a_bad_target() -> None:
    assert keep_chance(0.25, 0.5) == pytest.approx(0.5)
    assert keep_chance(0.9, 0.5) == 1.0
    assert keep_chance(0.0, 0.5) == 0.0
    with pytest.raises(ValueError, match="screen target"):
        keep_chance(0.5, 0.0)


def test_the_draw_is_fixed_by_the_task_id_and_spread() -> None:
    assert draw("t-1") == draw("t-1")
    draws = [draw(f"t-{i}") for i in range(2000)]
    assert all(0.0 <= d < 1.0 for d in draws)
    assert 0.45 < sum(d < 0.5 for d in draws) / len(draws) < 0.55


def test_a_multi_turn_env_and_an_empty_reference_are_not_judged() -> None:
    lookup = get_env("lookup")
    task = lookup.generate("train", 1, seed=0)[0].to_task(group_size=8)
    assert "multi-turn" in (TaskScreen.screenable(lookup, task) or "")
    reverse = get_env("reverse")
    bare = msgspec.structs.replace(reverse.generate("train", 1, seed=0)[0].to_task(group_size=8), reference="")
    assert "no reference" in (TaskScreen.screenable(reverse, bare) or "")


@pytest.mark.parametrize("temperature", [0.7, 1.0])
async def test_p_is_the_engines_probability_of_what_it_samples(temperature: float) -> None:
    """The screen opens a task exactly as the harness does, and its teacher-forced log-probability
    of a completion equals the sum of the per-token log-probs the engine recorded while sampling
    that completion at the same temperature: so p is the chance one sample writes the reference."""
    model, _ = build_tiny("tiny", seed=5)
    model.eval()
    env = get_env("reverse")
    engine = TorchEngine(model, TOK, max_batch=4, max_seq_len=64, device="cpu")
    await engine.start()
    try:
        task = env.generate("train", 1, seed=3)[0].to_task(group_size=4)
        params = SamplingParams(temperature=temperature, max_tokens=5)
        episodes = await rollout_episodes(engine, TOK, env, task, group_size=4, params=params, run_id="r")
    finally:
        await engine.stop()
    screen = TaskScreen(model, TOK, target=0.5, temperature=temperature)
    ids, prompt_len = screen.sequence(env, task)
    assert ids[prompt_len:] == TOK.encode(task.reference + env.terminator)  # no eos: sampling stops at the terminator
    for episode in episodes:
        sample = episode.samples[0]
        assert ids[:prompt_len] == sample.ids()[: sample.prompt_len]
        logp = screen.logprob(sample.ids(), sample.prompt_len)
        assert logp == pytest.approx(sum(sample.behaviour_logprobs()), abs=1e-4)
    # At another temperature the same tokens have another probability: the temperature is applied.
    # (On the reference, a fixed sequence: on a sampled one the two sums can meet by chance, and
    # once in CI they did, -27.7132 against -27.7139.)
    other = TaskScreen(model, TOK, target=0.5, temperature=temperature + 0.5)
    assert other.logprob(ids, prompt_len) != pytest.approx(screen.logprob(ids, prompt_len), abs=1e-2)
    assert screen.pass_chance(env, task) == pytest.approx(math.exp(screen.logprob(ids, prompt_len)))
