"""The traffic simulator against a real endpoint: the real `openai` client over loopback, a real TorchEngine.

What a seed fixes (users, sessions, words, follow-ups, the engine seed of every call) is fixed,
so two simulators with one seed against the same weights see the same answers; every call is
recorded by the endpoint under the simulator's session ids, and multi-turn sessions extend their
sample (one episode per session).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from slipstream.engine import TorchEngine, build_tiny
from slipstream.engine.tokenizer import ByteTokenizer
from slipstream.run.sim import PREFERENCES, SimConfig, Simulator
from slipstream.serve import MemorySink, ServeConfig, ServeEndpoint

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TOK = ByteTokenizer()


@pytest.fixture
async def endpoint() -> AsyncIterator[dict[str, Any]]:
    torch.set_num_threads(1)
    model, _ = build_tiny("tiny", seed=0)
    engine = TorchEngine(model, TOK, max_batch=16, max_seq_len=256, device="cpu")
    await engine.start()
    sink = MemorySink()
    ep = ServeEndpoint(
        engine, TOK, ServeConfig(enabled=True, port=0, renderer="tags", session_idle_s=60), sink, model_name="m"
    )
    await ep.start()
    try:
        yield {"ep": ep, "sink": sink}
    finally:
        await ep.close()
        await engine.stop()


def _played(sim: Simulator) -> list[tuple[str, int, str, str, bool]]:
    return sorted((t.session_id, t.turn, t.word, t.answer, t.accepted) for t in sim.stats.turns)


async def test_one_seed_plays_the_same_sessions_and_gets_the_same_answers(endpoint: dict[str, Any]) -> None:
    def config(seed: int) -> SimConfig:
        # An untrained model never satisfies `word_letters` often, so follow-ups (re-asks) happen.
        return SimConfig(
            base_url=endpoint["ep"].base_url,
            model="m",
            seed=seed,
            users=4,
            concurrency=4,
            follow_up=1.0,
            max_turns=2,
            feedback=False,
        )

    async with Simulator(config(3)) as a:
        await a.run_cycle(12)
    async with Simulator(config(3)) as b:
        await b.run_cycle(12)
    async with Simulator(config(4)) as c:
        await c.run_cycle(12)
    assert a.stats.sessions == 12 and not a.stats.failed_calls, a.stats.errors
    assert _played(a) == _played(b)
    assert [t.word for t in sorted(a.stats.turns, key=lambda t: t.session_id)] != [
        t.word for t in sorted(c.stats.turns, key=lambda t: t.session_id)
    ]
    # Re-asks happened (a rejected answer, follow_up 1.0), in the same session, about the same word.
    second = [t for t in a.stats.turns if t.turn == 1]
    assert second, "no follow-up turns"
    first = {t.session_id: t for t in a.stats.turns if t.turn == 0}
    assert all(first[t.session_id].word == t.word and not first[t.session_id].accepted for t in second)
    # Every answer carries the version that served it and its per-token segments.
    assert all(t.version == 0 and t.segments and t.segments[0][0] == 0 for t in a.stats.turns)
    assert all(t.accepted == PREFERENCES["word_letters"][1](t.word, t.answer.strip()) for t in a.stats.turns)
    acc, n = a.stats.acceptance()
    assert n == len(a.stats.turns) and 0.0 <= acc <= 1.0


async def test_sessions_are_recorded_as_one_growing_episode_each(endpoint: dict[str, Any]) -> None:
    cfg = SimConfig(
        base_url=endpoint["ep"].base_url,
        model="m",
        seed=1,
        users=2,
        concurrency=2,
        follow_up=1.0,
        max_turns=3,
        feedback=False,
    )
    async with Simulator(cfg) as sim:
        await sim.run_cycle(6)
    await endpoint["ep"].close()  # flushes every open session to the sink
    episodes = {e.metadata.get("session_id"): e for e in endpoint["sink"].episodes}
    turns: dict[str, int] = {}
    for t in sim.stats.turns:
        turns[t.session_id] = turns.get(t.session_id, 0) + 1
    assert set(episodes) == set(turns)
    for sid in turns:
        samples = episodes[sid].samples
        # The next turn's prompt is the previous prompt + answer + newline: the sample grows when
        # that is what was sampled; this untrained model's answers (cut by max_tokens, or bytes that
        # do not decode and re-encode to the same ids) start branches, never more than one a turn.
        assert 1 <= len(samples) <= len([t for t in sim.stats.turns if t.session_id == sid])
        sampled = sum(s.n_sampled() for s in samples)
        assert sampled == sum(len_ for t in sim.stats.turns if t.session_id == sid for _, len_ in t.segments)
    assert max(turns.values()) > 1


def test_config_refuses_what_it_cannot_play() -> None:
    with pytest.raises(ValueError, match="preference must be one of"):
        SimConfig(preference="polite")
    with pytest.raises(ValueError, match="probabilities"):
        SimConfig(follow_up=1.5)
