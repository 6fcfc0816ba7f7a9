"""Environments: deterministic generation, disjoint splits, scoring rules, the registry, the episode contract."""

from __future__ import annotations

import itertools
import random
from typing import Any, ClassVar

import msgspec
import pytest

from slipstream.envs import (
    Arith,
    ArithOptions,
    EnvError,
    Environment,
    Problem,
    Score,
    StepResult,
    TaskSpec,
    Transcript,
    get_env,
    register,
)
from slipstream.envs import registry as registry_module
from slipstream.schemas import Task, decode, encode

pytestmark = pytest.mark.unit

ENV_NAMES = ["arith", "reverse"]


def task_for(env: Environment[Any], prompt: str, reference: str) -> TaskSpec:
    return TaskSpec(task_id="t-0", env=env.name, prompt=prompt, reference=reference, seed=0, split="train")


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A copy of the registry, so test environments do not leak into other tests."""
    copy = dict(registry_module.ENVIRONMENTS)
    monkeypatch.setattr(registry_module, "ENVIRONMENTS", copy)
    return copy


# -- generation -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ENV_NAMES)
@pytest.mark.parametrize("split", ["train", "heldout"])
def test_same_seed_gives_same_tasks_and_other_seeds_differ(name: str, split: Any) -> None:
    env = get_env(name)
    first = env.generate(split, 50, seed=7)
    assert first == get_env(name).generate(split, 50, seed=7)
    assert len(first) == 50
    assert len({t.task_id for t in first}) == 50
    other = env.generate(split, 50, seed=8)
    assert [t.prompt for t in other] != [t.prompt for t in first]
    # A shorter call is a prefix of a longer one with the same seed.
    assert env.generate(split, 10, seed=7) == first[:10]
    assert env.generate(split, 0, seed=7) == []


def test_task_streams_are_pinned() -> None:
    # The task source and the eval gate regenerate tasks in other processes (and after upgrades):
    # the stream must not depend on PYTHONHASHSEED or on anything but (env, options, split, seed).
    assert [t.prompt for t in get_env("arith").generate("train", 4, seed=0)] == ["16+8=", "0+16=", "15+18=", "9+0="]
    assert [t.prompt for t in get_env("reverse").generate("heldout", 3, seed=0)] == ["rev oyow=", "rev bqw=", "rev pd="]
    assert get_env("arith").generate("train", 2, seed=0)[1].task_id == "arith-train-0-1"


@pytest.mark.parametrize("name", ENV_NAMES)
def test_train_and_heldout_never_share_a_problem(name: str) -> None:
    env = get_env(name)
    train = env.generate("train", 4000, seed=1)
    heldout = env.generate("heldout", 1000, seed=1)
    train_keys = {t.metadata["key"] for t in train}
    heldout_keys = {t.metadata["key"] for t in heldout}
    assert train_keys.isdisjoint(heldout_keys)
    assert {t.prompt for t in train}.isdisjoint({t.prompt for t in heldout})
    assert all(t.split == "train" and env.split_of(t.metadata["key"]) == "train" for t in train)
    assert all(t.split == "heldout" and env.split_of(t.metadata["key"]) == "heldout" for t in heldout)


def test_heldout_is_about_one_key_in_eight_and_independent_of_options() -> None:
    env = get_env("arith")
    keys = [f"{a}+{b}" for a, b in itertools.product(range(20), repeat=2)]
    held = [k for k in keys if env.split_of(k) == "heldout"]
    assert 25 <= len(held) <= 75, len(held)  # 400 keys, 1 in 8 expected: 50
    other = get_env("arith", max_operand=40, ops="+-")
    assert [other.split_of(k) for k in keys] == [env.split_of(k) for k in keys]


def test_arith_tasks_respect_options() -> None:
    env = get_env("arith", max_operand=5, ops="-")
    for t in env.generate("train", 300, seed=3):
        a, b = t.metadata["key"].split("-")
        assert 0 <= int(a) <= 5 and 0 <= int(b) <= 5
        assert t.prompt == f"{a}-{b}="
        assert int(t.reference) == int(a) - int(b)
    refs = {int(t.reference) for t in env.generate("train", 300, seed=3)}
    assert min(refs) < 0 < max(refs)


def test_reverse_tasks_respect_options() -> None:
    env = get_env("reverse", min_len=3, max_len=5, alphabet="xyz")
    tasks = env.generate("train", 300, seed=3)
    for t in tasks:
        word = t.metadata["key"]
        assert 3 <= len(word) <= 5 and set(word) <= set("xyz")
        assert t.prompt == f"rev {word}=" and t.reference == word[::-1]
    assert {len(t.metadata["key"]) for t in tasks} == {3, 4, 5}


def test_generate_rejects_bad_arguments_and_empty_splits() -> None:
    env = get_env("arith")
    with pytest.raises(ValueError, match="split"):
        env.generate("test", 1, seed=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n must"):
        env.generate("train", -1, seed=0)
    # max_operand=0 has one problem ("0+0"), so one of the two splits is empty.
    tiny = get_env("arith", max_operand=0)
    empty = "heldout" if tiny.split_of("0+0") == "train" else "train"
    with pytest.raises(ValueError, match=f"too few {empty}"):
        tiny.generate(empty, 1, seed=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ENV_NAMES)
def test_sft_example_is_reference_plus_terminator_and_scores_top(name: str) -> None:
    env = get_env(name)
    for t in env.generate("train", 200, seed=5) + env.generate("heldout", 50, seed=5):
        example = env.sft_example(t)
        assert example == t.reference + "\n"
        assert len(example) <= env.max_completion_chars
        s = env.score(t, example)
        assert (s.correct, s.parse_ok, s.reward) == (True, True, pytest.approx(1.1)), s


# -- scoring ------------------------------------------------------------------------------------

ARITH_CASES = [
    # completion, correct, parse_ok, reward, words in reason
    ("20\n", True, True, 1.1, "correct"),
    ("20", True, True, 1.1, "correct"),
    ("20\n7+7=14", True, True, 1.1, "correct"),  # past the terminator is ignored
    ("7\n", False, True, 0.1, "expected 20, got 7"),
    ("20 apples\n", True, True, 1.0, "trailing text"),
    ("20x", True, True, 1.0, "trailing text"),
    ("020\n", True, True, 1.0, "non-canonical"),
    ("", False, False, 0.0, "empty completion"),
    ("\n20", False, False, 0.0, "no integer"),
    (" 20\n", False, False, 0.0, "no integer"),
    ("twenty\n", False, False, 0.0, "no integer"),
    ("-\n", False, False, 0.0, "no integer"),
    ("9" * 10_000, False, True, 0.1, "expected 20"),  # no int() digit limit involved
]


@pytest.mark.parametrize(("completion", "correct", "parse_ok", "reward", "reason"), ARITH_CASES)
def test_arith_scoring(completion: str, correct: bool, parse_ok: bool, reward: float, reason: str) -> None:
    env = get_env("arith")
    s = env.score(task_for(env, "12+8=", "20"), completion)
    assert (s.correct, s.parse_ok) == (correct, parse_ok), s
    assert s.reward == pytest.approx(reward), s
    assert reason in s.reason
    assert set(s.components) == {"correct", "format"}
    assert s.reward == pytest.approx(sum(s.components.values()))


def test_arith_negative_answers() -> None:
    env = get_env("arith", ops="-")
    task = task_for(env, "3-5=", "-2")
    assert env.score(task, "-2\n").reward == pytest.approx(1.1)
    assert env.score(task, "2\n").components == {"correct": 0.0, "format": 0.1}
    assert env.score(task, "--2\n").parse_ok is False
    zero = task_for(env, "4-4=", "0")
    assert env.score(zero, "0").reward == pytest.approx(1.1)
    minus_zero = env.score(zero, "-0")
    assert (minus_zero.correct, minus_zero.components["format"]) == (True, 0.0)


def test_arith_reward_values_follow_options() -> None:
    env = get_env("arith", correct_reward=2.0, format_reward=0.5)
    task = task_for(env, "1+1=", "2")
    assert env.score(task, "2").components == {"correct": 2.0, "format": 0.5}
    assert env.score(task, "3").reward == pytest.approx(0.5)


REVERSE_CASES = [
    ("cba\n", True, True, 1.1, "correct"),
    ("cba", True, True, 1.1, "correct"),
    ("abc\n", False, True, 0.1, "expected 'cba', got 'abc'"),
    ("cb\n", False, True, 0.1, "got 'cb'"),
    ("cba!\n", True, True, 1.0, "trailing text"),
    ("cba d", True, True, 1.0, "trailing text"),
    ("", False, False, 0.0, "empty completion"),
    (" cba", False, False, 0.0, "no alphabet"),
    ("123\n", False, False, 0.0, "no alphabet"),
    ("CBA\n", False, False, 0.0, "no alphabet"),
]


@pytest.mark.parametrize(("completion", "correct", "parse_ok", "reward", "reason"), REVERSE_CASES)
def test_reverse_scoring(completion: str, correct: bool, parse_ok: bool, reward: float, reason: str) -> None:
    env = get_env("reverse")
    s = env.score(task_for(env, "rev abc=", "cba"), completion)
    assert (s.correct, s.parse_ok) == (correct, parse_ok), s
    assert s.reward == pytest.approx(reward), s
    assert reason in s.reason
    assert set(s.components) == {"correct", "format"}


@pytest.mark.parametrize("name", ENV_NAMES)
def test_components_sum_to_reward_on_random_completions(name: str) -> None:
    seed = 11
    rng = random.Random(seed)
    env = get_env(name)
    tasks = env.generate("train", 100, seed=seed)
    alphabet = "0123456789-abcz \n!"
    outcomes = set()
    for t in tasks:
        for completion in (
            "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6))),
            t.reference + rng.choice(["", "\n", " ", "x"]),
        ):
            s = env.score(t, completion)
            assert s.reward == sum(s.components.values()), (seed, completion, s)
            assert set(s.components) == set(env.components)
            assert s.parse_ok or (s.reward == 0.0 and not s.correct), (seed, completion, s)
            outcomes.add((s.correct, s.parse_ok))
    assert outcomes == {(True, True), (False, True), (False, False)}, (seed, outcomes)


def test_score_never_raises() -> None:
    env = get_env("arith")
    other = get_env("reverse")
    wrong_env = env.score(task_for(other, "rev ab=", "ba"), "ba")
    assert (wrong_env.parse_ok, wrong_env.reward) == (False, 0.0)
    assert "'reverse'" in wrong_env.reason
    not_text = env.score(task_for(env, "1+1=", "2"), None)  # type: ignore[arg-type]
    assert not not_text.parse_ok and "NoneType" in not_text.reason
    corrupt = env.score(task_for(env, "1+1=", "two"), "2")
    assert not corrupt.parse_ok and "reference 'two'" in corrupt.reason

    class Broken(Arith):
        def grade(self, task: TaskSpec, completion: str) -> Score:
            raise RuntimeError("boom")

    broken = Broken().score(task_for(env, "1+1=", "2"), "2")
    assert (broken.reward, broken.parse_ok, broken.components) == (0.0, False, {"correct": 0.0, "format": 0.0})
    assert broken.reason == "scorer error: RuntimeError: boom"


def test_scorer_version_names_env_version_and_non_default_options() -> None:
    assert get_env("arith").scorer_version == "arith@1"
    assert get_env("reverse").scorer_version == "reverse@1"
    a = get_env("arith", max_operand=50).scorer_version
    b = get_env("arith", max_operand=51).scorer_version
    assert a.startswith("arith@1+") and b.startswith("arith@1+") and a != b
    assert get_env("arith", max_operand=50).scorer_version == a


# -- registry -----------------------------------------------------------------------------------


def test_unknown_env_error_names_it_and_lists_known() -> None:
    with pytest.raises(EnvError, match=r"unknown environment 'nope'; known: arith, ") as info:
        get_env("nope")
    known = str(info.value).partition("known: ")[2].split(", ")
    assert known == sorted(known) and {"code", "humaneval", "lookup", "reverse", "search", "search_call"} <= set(known)


def test_unknown_option_error_names_it() -> None:
    with pytest.raises(EnvError, match=r"unknown option\(s\) colour, size for environment 'arith'"):
        get_env("arith", size=3, colour="red")


def test_bad_option_values_are_errors_naming_the_field() -> None:
    with pytest.raises(EnvError, match="max_operand"):
        get_env("arith", max_operand=-1)
    with pytest.raises(EnvError, match="ops"):
        get_env("arith", ops="*")
    with pytest.raises(EnvError, match="max_operand"):
        get_env("arith", max_operand="many")
    with pytest.raises(EnvError, match="min_len"):
        get_env("reverse", min_len=5, max_len=3)
    with pytest.raises(EnvError, match="alphabet"):
        get_env("reverse", alphabet="ab=")
    with pytest.raises(EnvError, match="format_reward"):
        get_env("reverse", format_reward=2.0)


def test_string_options_are_coerced() -> None:
    env = get_env("arith", max_operand="7", format_reward="0.2")
    assert env.options == ArithOptions(max_operand=7, format_reward=0.2)


def test_register_rejects_bad_and_duplicate_names(scratch_registry: dict[str, Any]) -> None:
    with pytest.raises(EnvError, match=r"name 'tasks\.x' must match"):
        register("tasks.x")
    with pytest.raises(EnvError, match="already registered"):
        register("arith")(type("Other", (Arith,), {}))
    assert scratch_registry["arith"] is Arith


# -- episodes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ENV_NAMES)
def test_single_turn_episode_is_done_after_one_step(name: str) -> None:
    env = get_env(name)
    task = env.generate("train", 1, seed=2)[0]
    episode = env.reset(task)
    assert episode.observation == task.prompt
    assert [m.role for m in episode.messages] == ["observation"]
    result = env.step(episode, "xyz\n")
    assert result == StepResult(observation=None, done=True, info={})
    assert (episode.done, episode.turns, episode.completion(), episode.policy_text()) == (True, 1, "xyz\n", "xyz\n")
    with pytest.raises(ValueError, match="already done"):
        env.step(episode, "again")


def test_reset_rejects_another_envs_task() -> None:
    with pytest.raises(ValueError, match="'reverse'"):
        get_env("arith").reset(get_env("reverse").generate("train", 1, seed=0)[0])


class Opts(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class Echo(Environment[Opts]):
    """Multi-turn toy: every output gets a tool observation until the policy says 'done'."""

    Options = Opts
    components: ClassVar[tuple[str, ...]] = ("done",)
    max_turns: ClassVar[int] = 3

    def sample(self, rng: random.Random) -> Problem:
        return Problem(key=str(rng.randint(0, 99)), prompt="go:", reference="done")

    def transition(self, episode: Transcript, model_output: str) -> StepResult:
        if model_output == "done":
            return StepResult(observation=None, done=True)
        return StepResult(observation=f"[tool saw {model_output}]", done=False, info={"tool": "echo"})

    def grade(self, task: TaskSpec, completion: str) -> Score:
        return Score.of({"done": float(completion.endswith("done"))}, correct=True, parse_ok=True, reason="")


def test_multi_turn_observations_are_kept_apart_from_policy_text(scratch_registry: dict[str, Any]) -> None:
    env = register("echo")(Echo)()
    episode = env.reset(env.generate("train", 1, seed=0)[0])
    first = env.step(episode, "a")
    assert (first.observation, first.done, first.info) == ("[tool saw a]", False, {"tool": "echo"})
    assert episode.observation == "[tool saw a]"
    assert env.step(episode, "done") == StepResult(observation=None, done=True)
    assert [m.role for m in episode.messages] == ["observation", "policy", "observation", "policy"]
    assert episode.policy_text() == "adone"
    assert episode.completion() == "a[tool saw a]done"
    assert episode.turns == 2


def test_multi_turn_episode_is_cut_at_max_turns(scratch_registry: dict[str, Any]) -> None:
    env = register("echo")(Echo)()
    episode = env.reset(env.generate("train", 1, seed=0)[0])
    results = [env.step(episode, out) for out in ("a", "b", "c")]
    assert [r.done for r in results] == [False, False, True]
    assert results[-1] == StepResult(observation=None, done=True, info={"tool": "echo", "truncated": "max_turns"})
    assert episode.turns == 3 and episode.done


# -- wire form ----------------------------------------------------------------------------------


def test_taskspec_round_trips_through_schemas_task() -> None:
    spec = get_env("reverse").generate("heldout", 1, seed=4)[0]
    task = spec.to_task(run_id="run-1", group_size=8, created_at=12.5)
    assert (task.run_id, task.group_size, task.created_at, task.split) == ("run-1", 8, 12.5, "heldout")
    assert task.reference == spec.reference and task.metadata == spec.metadata
    wire = decode(encode(task), Task)
    assert TaskSpec.from_task(wire) == spec


def test_from_task_rejects_unknown_split() -> None:
    task = Task(task_id="t-9", env="arith", prompt="1+1=", split="validation")
    with pytest.raises(ValueError, match="'validation'"):
        TaskSpec.from_task(task)
