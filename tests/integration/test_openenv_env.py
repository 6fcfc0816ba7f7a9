"""The `openenv` environment against a real OpenEnv server: `guess` (examples/openenv-guess),
served by openenv-core's own server code in a child process on a free loopback port.

A real TorchEngine (the tiny byte-level preset) plays groups of episodes through the harness.
Every episode must be, token for token, what the engine sampled plus what the server said:
its policy turns are the engine's completion ids (mask 1, the engine's log-probs), its
observations are the tokenizer's encoding of the server's observation texts (mask 0); and its
reward is the server's, recomputed here from the game's rule for the task's seed.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

pytest.importorskip("openenv.core.env_server")

from slipstream.engine import SamplingParams, TorchEngine, build_tiny
from slipstream.engine.tokenizer import ByteTokenizer
from slipstream.envs import get_env
from slipstream.envs.openenv_client import OpenEnv
from slipstream.envs.registry import EnvError
from slipstream.harness.provenance import RecordingEngine
from slipstream.harness.rollout import rollout_episodes
from slipstream.stack.process import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ALPHABET = "abcdefgh"
TOK = ByteTokenizer()


def expected_reward(seed: int, guesses: list[str]) -> float:
    """The guess game's rule, summed over the steps: 1.0 for the secret (the episode ends there),
    else 0.1 * (1 - |code distance| / 256) per wrong non-empty guess."""
    secret = random.Random(seed).choice(ALPHABET)
    total = 0.0
    for g in guesses[:3]:
        first = g.strip()[:1].lower()
        if first == secret:
            return total + 1.0
        total += 0.1 * (1.0 - abs(ord(first) - ord(secret)) / 256) if first else 0.0
    return total


async def test_openenv_episodes_are_what_the_engine_sampled_and_the_server_said(openenv_guess_server: str) -> None:
    torch.set_num_threads(1)
    model, _ = build_tiny("tiny", seed=0)
    engine = RecordingEngine(TorchEngine(model, TOK, max_batch=8, max_seq_len=1024, device="cpu"))
    await engine.start()
    env = get_env("openenv", base_url=openenv_guess_server, max_turns=3)
    params = SamplingParams(max_tokens=3, temperature=1.0, stop=["\n"], seed=5)
    episodes = []
    try:
        for task in env.generate("train", 2, seed=0):
            episodes += await rollout_episodes(engine, TOK, env, task, group_size=3, params=params)
    finally:
        await engine.stop()
    assert len(episodes) == 6
    by_id = {c.request_id: c for c in engine.calls}
    rewards = []
    for ep in episodes:
        (sample,) = ep.samples
        seed = int(ep.metadata["key"].removeprefix("seed-"))
        ids, n, mask, lps = sample.ids(), sample.prompt_len, sample.mask(), sample.behaviour_logprobs()
        policy = [t for t in sample.turns if t.role == "policy"]
        observations = [t for t in sample.turns if t.role != "policy"]
        assert 1 <= len(policy) <= 3 and len(observations) == len(policy) - 1
        calls = sorted(
            (c for rid, c in by_id.items() if rid.startswith(sample.sample_id)), key=lambda c: len(c.prompt_ids)
        )
        assert len(calls) == len(policy)
        for turn, call in zip(policy, calls, strict=True):
            assert ids[turn.start : turn.end] == list(call.completion_ids)
            assert mask[turn.start - n : turn.end - n] == [1] * (turn.end - turn.start)
            assert lps[turn.start - n : turn.end - n] == list(call.logprobs)
            assert list(call.prompt_ids) == ids[: turn.start]
        for turn in observations:
            assert ids[turn.start : turn.end] == TOK.encode(turn.text)
            assert mask[turn.start - n : turn.end - n] == [0] * (turn.end - turn.start)
            assert turn.text.startswith("\nNo: ")  # the server's feedback, verbatim
        guesses = [t.text.split("\n", 1)[0] for t in policy]
        want = expected_reward(seed, guesses)
        score = env.score(env.generate("train", 2, seed=0)[int(ep.task_id.rsplit("-", 1)[1])], ep)
        assert score.components == pytest.approx({"env": want}), (ep.episode_id, guesses, score)
        assert score.correct == (want >= 1.0)
        rewards.append(want)
    assert len(rewards) == 6
    assert type(env) is OpenEnv


def test_bad_options_fail_naming_them() -> None:
    with pytest.raises(EnvError, match="base_url"):
        get_env("openenv", base_url="localhost:8000")
    with pytest.raises(EnvError, match="unknown option"):
        get_env("openenv", url="http://x")


async def test_an_unreachable_server_fails_the_episode_loudly() -> None:
    env = get_env("openenv", base_url=f"http://127.0.0.1:{free_port()}")
    model, _ = build_tiny("tiny", seed=0)
    engine = TorchEngine(model, TOK, max_batch=2, max_seq_len=256, device="cpu")
    await engine.start()
    try:
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(
                rollout_episodes(
                    engine, TOK, env, env.generate("train", 1, 0)[0], group_size=1, params=SamplingParams(max_tokens=2)
                ),
                60,
            )
    finally:
        await engine.stop()
