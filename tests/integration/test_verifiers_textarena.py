"""A taskset verifiers ships, offline: its `textarena` taskset (TextArena's Hangman) through the
`verifiers` environment.

verifiers 0.4's `textarena` taskset (its `ta` extra: textarena 0.7.4 and nltk, installed in
`.venv-vf` by `make verifiers-venv`) is the only one it ships that needs no container or server;
its games read nltk's `words` corpus, which `nltk.download` fetches from the network. Offline
that download fails (nltk reports it and goes on) and the game reads the corpus from `NLTK_DATA`,
so this test writes a small word list there: the game, its engine stepping each move, its prompt
and its reward are TextArena's and verifiers' own code.

A random tiny model (real TorchEngine) plays: it never writes a `[letter]` move, so TextArena
warns once and ends the game on the second invalid move; every episode is then two policy turns
in one sample with the game's feedback, rendered by verifiers, at mask 0 between them. Checked:
the prompt is what verifiers rendered (its system prompt, then the game's board), every sampled
id and log-prob is the engine's, and the reward is the game's (`vf.game_reward`: the share of
the word's letters revealed, 0 here).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from slipstream.engine import SamplingParams, TorchEngine, build_tiny
from slipstream.engine.tokenizer import ByteTokenizer
from slipstream.envs import get_env
from slipstream.envs.verifiers.bridge import Bridge
from slipstream.harness.provenance import RecordingEngine
from slipstream.harness.rollout import rollout_episodes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-vf"
PYTHON = VENV / "bin" / "python"
TOK = ByteTokenizer()
WORDS = ["apple", "bread", "chair", "house", "light", "water", "stone", "river"]

if not PYTHON.exists():
    pytest.skip(
        f"verifiers' venv {PYTHON} is not built (make verifiers-venv; CI skips: libs/envs README)",
        allow_module_level=True,
    )
if not list(VENV.glob("lib/python*/site-packages/textarena")):
    pytest.skip(f"{VENV} has no textarena (make verifiers-venv installs it)", allow_module_level=True)

OPTIONS = {
    "python": str(PYTHON),
    "env": {
        "taskset": {"id": "textarena", "game": "Hangman-v0"},
        "player": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}},
    },
    "tasks": 4,
    "sampling": {"max_tokens": 6},
}


@pytest.fixture
async def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[RecordingEngine]:
    corpus = tmp_path / "nltk_data" / "corpora" / "words"
    corpus.mkdir(parents=True)
    for name in ("en", "en-basic"):  # Hangman-v0 draws from en-basic, its hardcore variant from en
        (corpus / name).write_text("\n".join(WORDS) + "\n")
    monkeypatch.setenv("NLTK_DATA", str(tmp_path / "nltk_data"))  # the runner process inherits it
    torch.set_num_threads(1)
    model, _ = build_tiny("tiny", seed=0)
    eng = RecordingEngine(TorchEngine(model, TOK, max_batch=8, max_seq_len=2048, device="cpu"))
    await eng.start()
    try:
        yield eng
    finally:
        await Bridge.close_all()
        await eng.stop()


async def test_textarena_hangman_plays_offline_with_the_engine_sampling_every_move(engine: RecordingEngine) -> None:
    env = get_env("verifiers", **OPTIONS)
    params = SamplingParams(max_tokens=6, temperature=1.0)
    episodes = []
    tasks = env.generate("train", 2, seed=0)
    for task in tasks:
        episodes += await rollout_episodes(engine, TOK, env, task, group_size=2, params=params)
    assert len(episodes) == 4
    calls = {c.request_id: c for c in engine.calls}
    for ep in episodes:
        (sample,) = ep.samples  # each turn's prompt extends the last: one sample
        ids, n, mask = sample.ids(), sample.prompt_len, sample.mask()
        prompt = TOK.decode(ids[1:n])
        assert ids[0] == TOK.bos_id and prompt.startswith("system: You are a competitive game player."), prompt
        assert "You are playing Hangman." in prompt and prompt.endswith("\nassistant: "), prompt
        mine = sorted(
            (c for rid, c in calls.items() if rid.startswith(sample.sample_id)), key=lambda c: len(c.prompt_ids)
        )
        assert len(mine) == 2, [TOK.decode(list(c.completion_ids)) for c in mine]  # warned once, then lost
        first, second = mine
        assert list(first.prompt_ids) == ids[:n] and list(second.prompt_ids) == ids[: len(second.prompt_ids)]
        end_first = n + len(first.completion_ids)
        assert ids[n:end_first] == list(first.completion_ids)
        assert ids[len(second.prompt_ids) :] == list(second.completion_ids)
        feedback = TOK.decode(ids[end_first : len(second.prompt_ids)])
        assert "attempted an invalid move" in feedback and feedback.endswith("\nassistant: "), feedback
        assert mask == [1] * len(first.completion_ids) + [0] * (len(second.prompt_ids) - end_first) + [1] * len(
            second.completion_ids
        )
        recorded = sample.behaviour_logprobs()
        assert [recorded[i] for i, m in enumerate(mask) if m] == [*first.logprobs, *second.logprobs]
        score = env.score(next(t for t in tasks if t.task_id == ep.task_id), ep)
        assert score.components == {"vf.game_reward": 0.0}, (ep.episode_id, score)
