"""`programs` tasks through the real harness and real sandboxes: the scripted expert fixes one task of
every template (every bug kind), the fresh grader agrees, and the imperfect expert's guess fails."""

from __future__ import annotations

import pytest

from slipstream.engine import ByteTokenizer, GenerationRequest, SamplingParams
from slipstream.envs import get_env
from slipstream.envs.base import TaskSpec
from slipstream.envs.code import programs as P
from slipstream.envs.code.tasks import task_of_key
from slipstream.harness import rollout_episodes
from slipstream.sandbox import cgroups
from slipstream.schemas import Episode
from slipstream.supervised import ScriptedEngine

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(cgroups.available() is not None, reason=f"no cgroups here: {cgroups.available()}"),
]

TOK = ByteTokenizer()
OPTIONS = {"source": "programs", "max_turns": 4, "max_turn_tokens": 128, "length_penalty": {"scale": 0.0005}}


def _task(key: str) -> TaskSpec:
    code = task_of_key(key)
    split = "heldout" if P.split_of(key) == "heldout" else "train"
    meta = {"key": key}
    return TaskSpec(
        task_id=key, env="code", prompt=code.prompt, reference=code.reference, seed=0, split=split, metadata=meta
    )


async def _play(env: object, task: TaskSpec) -> Episode:
    def reply(_: GenerationRequest, context: str) -> str:
        return env.expert(task, context)  # type: ignore[attr-defined]

    params = SamplingParams(temperature=1.0, max_tokens=128)
    (episode,) = await rollout_episodes(ScriptedEngine(TOK, reply), TOK, env, task, group_size=1, params=params)  # type: ignore[arg-type]
    return episode


async def test_the_expert_fixes_every_template_within_a_128_token_turn() -> None:
    env = get_env("code", **OPTIONS)
    for template in P.templates():
        task = _task(f"programs:{template}:3")
        episode = await _play(env, task)
        assert [e.name for e in episode.tool_log] == ["replace", "run_tests"], template
        assert episode.tool_log[1].result == "3 passed, 0 failed", template
        score = env.score(task, episode)
        assert score.correct, (template, score.reason)
        # The length penalty is on: the expert's ~160-token episode pays 0.04-0.08 of its 1.0.
        assert -0.08 < score.components["length"] < -0.04, template
        assert score.components["tests_passed"] == 0.5 and score.components["all_passed"] == 0.5


async def test_the_guessing_expert_fails_the_tests_and_stops() -> None:
    env = get_env("code", **OPTIONS, expert_guess_rate=1.0)
    for template in ("arith.wrong_operator", "count_if.swapped_args", "safe_div.missing_case", "slice.off_by_one"):
        task = _task(f"programs:{template}:3")
        episode = await _play(env, task)
        assert [e.name for e in episode.tool_log] == ["replace", "run_tests"], template
        assert not env.score(task, episode).correct, template
