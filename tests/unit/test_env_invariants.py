"""The episode invariants, run on EVERY registered environment (plus two local agentic ones).

Each environment is played by two policies through the real harness: a tiny randomly initialised
model (what anything may emit) and the environment's scripted expert (the multi-turn path: tool
calls, results, answers). For every episode:

1. each sample's concatenation reproduces every engine call's prompt + completion ids exactly,
   and observation ids are the tokenizer's encoding of their text (token_problems);
2. the loss mask covers exactly the engine-sampled tokens (token_problems);
3. through the learner's credit path (slipstream.rl.credit.group_rows), every sampled token of a
   trainable sample trains with its episode's advantage, no observation or frozen token does;
4. a context edit is a new sample, started after its parent's last engine call, sharing
   exactly `branch_pos` leading ids, and the parent's ids are never rewritten;
5. the episode survives the wire and its score carries every component, summing to the reward.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import search_backend  # noqa: F401  (registers the test backend "terms" that `search` plays against here)
from agentic_envs import LOCAL_ENVS

from slipstream.engine import ByteTokenizer, CausalLM, SamplingParams, TorchEngine, build_tiny
from slipstream.envs import ENVIRONMENTS, get_env, task_envs, task_of
from slipstream.envs.base import Environment
from slipstream.harness import RecordingEngine, rollout_episodes, token_problems
from slipstream.harness.episode import sample_of_request
from slipstream.rl.credit import group_rows, token_advantages
from slipstream.schemas import Episode, ScoredEpisode, decode, encode
from slipstream.supervised import ScriptedEngine

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

TOK = ByteTokenizer()
GROUP = 3
ALL_ENVS = [*task_envs(), *sorted(LOCAL_ENVS)]  # `serve` scores traffic: no tasks to play


@pytest.fixture(scope="module")
def model() -> CausalLM:
    m, _ = build_tiny("tiny", seed=3)
    return m.eval()


@pytest.fixture
async def random_engine(model: CausalLM) -> AsyncIterator[RecordingEngine]:
    eng = RecordingEngine(TorchEngine(model, TOK, max_batch=8, max_seq_len=512, device="cpu"))
    await eng.start()
    yield eng
    await eng.stop()


# Options an environment needs to play here: `search` needs a search backend, and until
# libs/retrieval registers its in-process hybrid one, the suite uses the deterministic test one.
# `swarm` (whose sub-agents search) gets two items a task, so its prompt fits the random engine's 512 tokens.
ENV_OPTIONS: dict[str, dict[str, Any]] = {
    "search": {"backend": "terms"},
    # (its sub-agents grep the clues: 2 steps each, so the expert's episodes fit the budget)
    "swarm": {
        "search": {"backend": "terms", "tools_line": False, "expert_grep": True},
        "wide_min": 2,
        "wide_max": 2,
    },
}


REPO = Path(__file__).resolve().parents[2]
VF_PYTHON = REPO / ".venv-vf" / "bin" / "python"


@pytest.fixture(scope="module")
def external(request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    """Options of the environments that play against something outside this process: `openenv`
    against the repository's OpenEnv guess server (tests/conftest.py starts it on a free port).
    `verifiers` runs verifiers in its own venv (`make verifiers-venv`); without it, it is skipped by
    name (tests/integration/test_verifiers_env.py checks its tokens when it is built)."""
    out: dict[str, dict[str, Any]] = {}
    if "openenv" in ALL_ENVS:
        out["openenv"] = {"base_url": request.getfixturevalue("openenv_guess_server")}
    if "verifiers" in ALL_ENVS and VF_PYTHON.exists():
        out["verifiers"] = {  # the repository's single-turn taskset, played by verifiers' `null` harness
            "python": str(VF_PYTHON),
            "pythonpath": [str(REPO / "examples" / "verifiers-envs")],
            "env": {
                "taskset": {"id": "vf_sum"},
                "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}},
            },
            "tasks": 16,
        }
    return out


def _env(name: str, external: dict[str, dict[str, Any]]) -> Environment[Any]:
    if name == "verifiers" and not VF_PYTHON.exists():
        pytest.skip(f"verifiers plays in its own venv: {VF_PYTHON} is not built (make verifiers-venv; CI skips)")
    if name in LOCAL_ENVS:
        return LOCAL_ENVS[name]()
    return get_env(name, **{**ENV_OPTIONS.get(name, {}), **external.get(name, {})})


def _has_expert(env: Environment[Any], split: str) -> bool:
    """An env with a scripted expert of its own, or tasks whose reference the default expert writes."""
    if type(env).expert is not Environment.expert:
        return True
    return bool(env.generate("heldout" if env.eval_only else split, 1, seed=5)[0].reference)  # type: ignore[arg-type]


async def _play(env: Environment[Any], policy: str, engine: RecordingEngine, split: str) -> list[Episode]:
    if env.eval_only:
        split = "heldout"  # an eval suite (humaneval) has no train split
    task = env.generate(split, 1, seed=5)[0]  # type: ignore[arg-type]
    params = SamplingParams(temperature=1.0, max_tokens=16)
    if policy == "expert":
        engine = RecordingEngine(ScriptedEngine(TOK, lambda _req, context: env.expert(task, context)))
        # Room for the expert's longest turn (humaneval writes a whole function in one call).
        params = SamplingParams(temperature=1.0, max_tokens=max(256, env.max_completion_chars + 1))
    episodes = await rollout_episodes(engine, TOK, env, task, group_size=GROUP, params=params, group_id=f"g-{split}")
    for e in episodes:
        problems = token_problems(e, engine.calls_of(e), TOK)
        assert problems == [], f"{env.name} ({policy}): {problems}"
        _check_edits(e, engine)
    return episodes


def _check_edits(episode: Episode, engine: RecordingEngine) -> None:
    order = [sample_of_request(c.request_id) for c in engine.calls_of(episode)]
    for s in episode.samples:
        if not s.branch_of:
            assert s.edit == "" and s.branch_pos == 0
            continue
        parent = episode.sample(s.branch_of)
        # The parent took no engine call after the edit, and its prefix is the branch's.
        parent_calls = [i for i, sid in enumerate(order) if sid == parent.sample_id]
        child_calls = [i for i, sid in enumerate(order) if sid == s.sample_id]
        if parent_calls and child_calls:
            assert max(parent_calls) < min(child_calls)
        assert parent.finish_reason == "edit"
        assert s.ids()[: s.branch_pos] == parent.ids()[: s.branch_pos]
        assert s.prompt_len >= s.branch_pos and s.sample_id != parent.sample_id


def _check_credit(env: Environment[Any], episodes: list[Episode]) -> None:
    # Distinct rewards, so every episode's advantage differs from its neighbours' and from zero.
    scored = [ScoredEpisode(episode=e, reward=float(i), components={}) for i, e in enumerate(episodes)]
    mean = (GROUP - 1) / 2
    rows = group_rows(scored)
    for e, r in zip(episodes, rows, strict=True):
        advantage = float(e.group_index) - mean
        trained = [s for s in e.samples if s.trainable and s.n_sampled() > 0]
        assert r.sample_ids == [s.sample_id for s in trained], "every trainable sample is a row, no frozen one"
        for item, sample in zip(r.items, trained, strict=True):
            assert item.advantage == pytest.approx(advantage)
            assert item.token_ids == sample.ids() and item.loss_mask == sample.mask()
        per_token = token_advantages(e, {agent: advantage for agent in {s.agent_id for s in e.samples}})
        for sample, advs in zip(e.samples, per_token, strict=True):
            for m, a in zip(sample.mask(), advs, strict=True):
                expected = advantage if (m and sample.trainable) else 0.0
                assert a == pytest.approx(expected), f"{env.name}: sample {sample.sample_id} token mask {m}"


@pytest.mark.parametrize("split", ["train", "heldout"])
@pytest.mark.parametrize("policy", ["random", "expert"])
@pytest.mark.parametrize("name", ALL_ENVS)
async def test_episode_invariants_hold_for_every_environment(
    name: str, policy: str, split: str, random_engine: RecordingEngine, external: dict[str, dict[str, Any]]
) -> None:
    env = _env(name, external)
    if policy == "expert" and not _has_expert(env, split):
        pytest.skip(f"{name} has no expert: only the environment outside knows its answers (random plays it)")
    episodes = await _play(env, policy, random_engine, split)
    assert [e.group_index for e in episodes] == list(range(GROUP))
    _check_credit(env, episodes)
    for e in episodes:
        assert decode(encode(e), Episode) == e
        assert any(s.trainable and s.n_sampled() > 0 for s in e.samples)
        score = env.score(task_of(e), e)
        assert set(env.components) <= set(score.components)
        assert score.reward == pytest.approx(sum(score.components.values()))


async def test_the_suite_sees_edits_frozen_agents_and_tool_calls(
    random_engine: RecordingEngine, external: dict[str, dict[str, Any]]
) -> None:
    """The suite above is not vacuous: some environment edits its context, one spawns a frozen
    agent, one calls tools, and the expert of every registered env scores as correct."""
    seen: dict[str, int] = {"edit": 0, "frozen": 0, "tool_calls": 0}
    for name in ALL_ENVS:
        if name == "verifiers" and not VF_PYTHON.exists():
            continue  # its own venv is not built here (see `external`)
        env = _env(name, external)
        if not _has_expert(env, "train"):
            continue  # openenv, verifiers: only the environment outside knows the answers
        for e in await _play(env, "expert", random_engine, "train"):
            seen["edit"] += sum(1 for s in e.samples if s.branch_of)
            seen["frozen"] += sum(1 for s in e.samples if not s.trainable)
            seen["tool_calls"] += e.counts.get("tool_calls", 0)
            if name in ENVIRONMENTS:
                assert env.score(task_of(e), e).correct, f"{name}'s expert is not correct: {e.final_text!r}"
    assert seen["edit"] >= GROUP and seen["frozen"] >= GROUP and seen["tool_calls"] >= GROUP
