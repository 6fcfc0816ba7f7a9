"""The `code` environment through the real harness and real sandboxes: play, patch, grade afresh.

Policies are scripted (ScriptedEngine) so each test knows what the agent did; every tool call runs
in a real bubblewrap sandbox and every grade runs the task's tests in a new one.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import msgspec
import pytest

from slipstream.engine import ByteTokenizer, GenerationRequest, SamplingParams
from slipstream.envs import get_env
from slipstream.envs.base import TaskSpec
from slipstream.envs.code import task_of_key
from slipstream.envs.code.grader import HIDDEN_CASES
from slipstream.harness import rollout_episodes
from slipstream.sandbox import cgroups
from slipstream.schemas import Episode
from slipstream.supervised import ScriptedEngine
from slipstream.toolcalls import ToolCall, renderer_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(cgroups.available() is not None, reason=f"no cgroups here: {cgroups.available()}"),
]

TOK = ByteTokenizer()
TAGS = renderer_for("tags")


def call(name: str, **arguments: str) -> str:
    return TAGS.render_calls("", [ToolCall(id="x", name=name, arguments=arguments)])


async def play(env_options: dict, task: TaskSpec, script: Callable[[int, str], str]) -> Episode:
    env = get_env("code", **env_options)
    turns = iter(range(100))

    def reply(_: GenerationRequest, context: str) -> str:
        return script(next(turns), context)

    engine = ScriptedEngine(TOK, reply)
    params = SamplingParams(temperature=1.0, max_tokens=512)
    (episode,) = await rollout_episodes(engine, TOK, env, task, group_size=1, params=params)
    return episode


@pytest.fixture
def task() -> TaskSpec:
    return get_env("code").generate("train", 1, seed=11)[0]


async def test_the_expert_fixes_the_bug_and_the_fresh_grader_agrees(task: TaskSpec) -> None:
    env = get_env("code")
    episode = await play({}, task, lambda _, ctx: env.expert(task, ctx))
    assert [e.name for e in episode.tool_log] == ["replace", "run_tests"]
    assert episode.tool_log[1].result == "3 passed, 0 failed"
    patch = json.loads(episode.final_text)
    assert list(patch) == ["ops.py"] and patch["ops.py"] == task_of_key(task.metadata["key"]).meta["fixed"]
    # The reward-model's view of the task has no prompt; the reference alone rebuilds the tree.
    assert env.score(msgspec.structs.replace(task, prompt="", metadata={}), episode).correct
    score = env.score(task, episode)
    assert score.components == {
        "tests_passed": 0.5,
        "all_passed": 0.5,
        "invalid_call": 0.0,
        "unfinished_edit": 0.0,
        "length": 0.0,
    }
    # 3 visible tests and HIDDEN_CASES hidden ones (grader.py), all passing.
    assert score.correct and score.reason == f"{3 + HIDDEN_CASES}/{3 + HIDDEN_CASES} tests passed"


async def test_an_imperfect_expert_guesses_the_other_operator_on_a_fixed_share_of_tasks() -> None:
    env = get_env("code", expert_guess_rate=0.4)
    tasks = env.generate("train", 200, seed=3)
    guessed = []
    for t in tasks:
        first = env.expert(t, t.prompt)
        ref = json.loads(t.reference)
        assert first == get_env("code", expert_guess_rate=0.4).expert(t, t.prompt)  # a function of the task
        if ref["new"] not in first:
            # The other wrong operator: neither the planted one nor the fix.
            ops = {ref["old"].split()[1], ref["new"].split()[1]}
            assert f'"old": "{ref["old"]}"' in first and ({"+", "-", "*"} - ops).pop() in first.split('"new"')[1]
            guessed.append(t)
    assert 0.3 < len(guessed) / len(tasks) < 0.5
    perfect = get_env("code")  # the default expert always writes the reference fix
    assert all(json.loads(t.reference)["new"] in perfect.expert(t, t.prompt) for t in tasks)
    # Played through, a guess fails the tests and the expert stops all the same.
    wrong = guessed[0]
    episode = await play({"expert_guess_rate": 0.4}, wrong, lambda _, ctx: env.expert(wrong, ctx))
    assert [e.name for e in episode.tool_log] == ["replace", "run_tests"]
    assert not env.score(wrong, episode).correct
    with pytest.raises(ValueError, match="expert_guess_rate"):
        get_env("code", expert_guess_rate=1.5)


async def test_grading_ignores_what_the_agent_did_to_the_tests(task: TaskSpec) -> None:
    """The agent deletes the failing tests and writes a passing one: its own run passes, the grade does not."""
    env = get_env("code")

    def cheat(turn: int, _: str) -> str:
        if turn == 0:
            return call("create_file", path="test_ops.py", content="def test_ok():\n    assert True\n")
        if turn == 1:
            return call("run", command="echo 'print(\"0 failed\")' > _run_tests.py; rm -f ops.py; echo gone > ops.py")
        if turn == 2:
            return call("run_tests")
        return "done\n"

    episode = await play({}, task, cheat)
    assert set(json.loads(episode.final_text)) == {"test_ops.py", "_run_tests.py", "ops.py"}
    score = env.score(task, episode)
    # ops.py was really replaced (that edit counts), the tests and the runner were restored from the task.
    assert score.reward == 0.0 and not score.correct
    # (the broken ops.py does not import: nothing passes)
    assert score.reason == (
        "ops did not import: NameError: name 'gone' is not defined; "
        "ignored edits to protected ['_run_tests.py', 'test_ops.py']"
    )


async def test_a_partial_fix_earns_the_fraction_and_an_unchecked_edit_is_penalised(task: TaskSpec) -> None:
    env = get_env("code")
    code = task_of_key(task.metadata["key"])
    name = code.meta["fixed"].split("(")[0].removeprefix("def ")
    # A lookup table that answers only the first test's case, then stop without running the tests.
    first = code.files["test_ops.py"].split("assert ")[1].split("\n")[0]  # "<name>(a, b) == want"
    a_b, want = first.split(" == ")
    a, b = a_b.removeprefix(f"{name}(").rstrip(")").split(", ")
    content = f"def {name}(a, b):\n    return {want} if (a, b) == ({a}, {b}) else -999\n"
    episode = await play(
        {}, task, lambda t, _: call("create_file", path="ops.py", content=content) if t == 0 else "ok\n"
    )
    score = env.score(task, episode)
    # One visible test of 3 passes; the hidden cases (the reference's results on other arguments) do not.
    total = 3 + HIDDEN_CASES
    assert score.components["tests_passed"] == pytest.approx(0.5 / total)
    assert score.components["all_passed"] == 0.0
    assert score.components["unfinished_edit"] == -0.1
    assert score.reason.startswith(f"1/{total} tests passed; failing: test_")
    assert score.reason.endswith(f"; {HIDDEN_CASES}/{HIDDEN_CASES} hidden cases wrong; unchecked edit")


async def test_malformed_calls_are_counted_negatives_and_the_length_penalty_applies(task: TaskSpec) -> None:
    options = {"length_penalty": {"k": 0.1, "q": 0.5, "scale": 0.01, "per_token": 0.0, "per_turn": 40.0}}

    def sloppy(turn: int, _: str) -> str:
        if turn == 0:
            return '<tool>{"name": "replace", "args": {"path": "ops.py"}}</tool>'  # missing old/new
        if turn == 1:
            return call("replace", path="ops.py", old="no such text", new="x")  # not found: the model's fault
        if turn == 2:
            ref = json.loads(task.reference)
            return call("replace", path=ref["path"], old=ref["old"], new=ref["new"])
        return call("run_tests") if turn == 3 else "done\n"

    episode = await play({"length_penalty": options["length_penalty"]}, task, sloppy)
    assert episode.counts["invalid_tool_call"] == 2
    assert "error: invalid arguments for replace: the snippet is not found in ops.py" in episode.tool_log[1].error
    scored = get_env("code", **options).score(task, episode)
    assert scored.components["invalid_call"] == pytest.approx(-0.4)
    turns = episode.counts["turns"]  # effort = 40 per turn -> C = 2 (sqrt(1 + 4 turns) - 1) / 0.1
    assert scored.components["length"] == pytest.approx(-0.01 * 20 * ((1 + 4 * turns) ** 0.5 - 1))
    assert scored.components["all_passed"] == 0.5


@pytest.mark.parametrize("number", [0, 2, 4])
def test_humaneval_canonical_solutions_pass_and_the_bare_prompt_fails(number: int) -> None:
    env = get_env("code", source="humaneval")
    code = task_of_key(f"humaneval:{number}")
    spec = TaskSpec(
        task_id=f"he-{number}",
        env="code",
        prompt=code.prompt,
        reference=code.reference,
        seed=0,
        split="heldout",
        metadata={"key": code.key},
    )
    solution = json.loads(code.reference)["content"]
    good = env.score(spec, json.dumps({"solution.py": solution}))
    assert good.correct and good.reward == 1.0, good.reason
    bare = env.score(spec, json.dumps({}))
    assert not bare.correct and bare.reward == 0.0
    assert env.score(spec, "not json").reason.startswith("the answer is not a patch")
