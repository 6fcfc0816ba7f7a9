"""The `lookup` tool-use environment: disjoint splits, the tool protocol, invalid calls tagged and
penalised, the call budget, and the scripted expert (played through the real harness)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from slipstream.engine import ByteTokenizer, SamplingParams
from slipstream.engine.interface import GenerationRequest
from slipstream.envs import EnvError, get_env, task_of
from slipstream.envs.lookup import Lookup
from slipstream.harness import RecordingEngine, rollout_episodes, token_problems
from slipstream.schemas import Episode
from slipstream.supervised import ScriptedEngine, expert_episodes

pytestmark = pytest.mark.unit

TOK = ByteTokenizer()
ENV = get_env("lookup")
assert isinstance(ENV, Lookup)


def _scripted(replies: list[str]) -> RecordingEngine:
    it: Iterator[str] = iter(replies)

    def reply(_: GenerationRequest, __: str) -> str:
        return next(it)

    return RecordingEngine(ScriptedEngine(TOK, reply))


async def _play(env: Lookup, replies: list[str], split: str = "train") -> Episode:
    task = env.generate(split, 1, seed=2)[0]
    engine = _scripted(replies)
    (e,) = await rollout_episodes(engine, TOK, env, task, params=SamplingParams(max_tokens=128))
    assert token_problems(e, engine.calls_of(e), TOK) == []
    return e


def test_splits_are_deterministic_and_share_no_problem() -> None:
    train = ENV.generate("train", 600, seed=0)
    heldout = ENV.generate("heldout", 200, seed=0)
    assert ENV.generate("train", 600, seed=0) == train
    train_keys = {t.metadata["key"] for t in train}
    held_keys = {t.metadata["key"] for t in heldout}
    assert train_keys.isdisjoint(held_keys)
    assert len(held_keys) > 50 and len(train_keys) > 300
    for t in heldout[:20]:
        assert t.prompt == f"key {t.metadata['key']}?\n" and t.reference == ENV.value(t.metadata["key"])
        assert 100 <= int(t.reference) <= 999
    # Another salt, another table: the values are a lookup, not a function a model could learn.
    other = get_env("lookup", salt="other")
    assert sum(other.value(k) != ENV.value(k) for k in list(held_keys)[:50]) >= 45


async def test_a_correct_episode_calls_the_tool_then_answers() -> None:
    task = ENV.generate("train", 1, seed=2)[0]
    key = task.metadata["key"]
    e = await _play(ENV, [ENV.call_text(key), task.reference + "\n"])
    (s,) = e.samples
    text = TOK.decode(s.ids())
    call = f'<tool>{{"name": "get", "args": {{"key": "{key}"}}}}</tool>'
    assert text == f"key {key}?\n{call}<result>{task.reference}</result>\n{task.reference}\n"
    assert [t.role for t in s.turns] == ["policy", "observation", "policy"]
    assert e.counts == {"turns": 2, "tool_calls": 1, "samples": 1}
    assert [(ev.name, ev.status, ev.result) for ev in e.tool_log] == [("get", "ok", task.reference)]
    score = ENV.score(task, e)
    assert score.components == {"correct": 1.0, "invalid_call": 0.0} and score.correct


@pytest.mark.parametrize(
    ("bad", "kind"),
    [
        ('<tool>{"name": "get", "args": {"key": 12}}</tool>', "bad_arguments"),
        ('<tool>{"name": "gte", "args": {"key": "12"}}</tool>', "unknown_tool"),
        ('<tool>{"name": "get", "args": {"key": "1</tool>', "bad_json"),
    ],
)
async def test_an_invalid_call_is_shown_tagged_counted_and_penalised(bad: str, kind: str) -> None:
    task = ENV.generate("train", 1, seed=2)[0]
    e = await _play(ENV, [bad, ENV.call_text(task.metadata["key"]), task.reference + "\n"])
    assert e.counts["invalid_tool_call"] == 1 and e.counts["tool_calls"] == 2 and e.counts["turns"] == 3
    assert [ev.status for ev in e.tool_log] == ["invalid_tool_call", "ok"]
    assert e.tool_log[0].info == {"kind": kind} and e.tool_log[0].error.startswith("error:")
    (s,) = e.samples
    first_obs = next(t for t in s.turns if t.role == "observation")
    assert first_obs.text == f"<result>{e.tool_log[0].error}</result>\n"
    assert e.infra_error == ""
    score = ENV.score(task_of(e), e)
    assert score.components == {"correct": 1.0, "invalid_call": pytest.approx(-0.2)}
    assert score.reward == pytest.approx(0.8) and score.correct
    harsh = get_env("lookup", invalid_call_penalty=0.5)
    assert harsh.score(task_of(e), e).reward == pytest.approx(0.5)


async def test_calls_past_the_budget_end_the_episode_unanswered() -> None:
    bad = '<tool>{"name": "get"}</tool>'
    e = await _play(ENV, [bad, bad, bad])
    assert e.finish_reason == "max_calls" and e.final_text == ""
    assert e.counts["invalid_tool_call"] == 2 and e.counts["over_call_budget"] == 1 and e.counts["turns"] == 3
    score = ENV.score(task_of(e), e)
    assert score.reward == pytest.approx(-0.4) and not score.correct and not score.parse_ok


async def test_answering_without_the_tool_is_one_turn_and_judged_on_its_text() -> None:
    task = ENV.generate("heldout", 1, seed=2)[0]
    wrong = str(100 + (int(task.reference) - 99) % 900)
    e = await _play(ENV, [wrong + "\n"], split="heldout")
    assert e.counts == {"turns": 1, "samples": 1} and e.final_text == wrong + "\n"
    assert ENV.score(task, e).components == {"correct": 0.0, "invalid_call": 0.0}


async def test_the_expert_solves_every_task_in_two_turns() -> None:
    tasks = ENV.generate("heldout", 20, seed=1)
    episodes = await expert_episodes(ENV, TOK, tasks)
    for t, e in zip(tasks, episodes, strict=True):
        assert ENV.score(t, e).correct and e.counts["turns"] == 2 and e.counts["tool_calls"] == 1


async def test_the_imperfect_teacher_guesses_and_slips_on_fixed_fractions_of_keys() -> None:
    """With expert_guess_rate / expert_slip_rate the expert answers some keys without the tool
    (always wrong) and makes a malformed first call on some others, then corrects it; the choice is
    a function of the key, so a repeated key replays the same episode."""
    env = get_env("lookup", expert_guess_rate=0.3, expert_slip_rate=0.4)
    tasks = env.generate("train", 400, seed=3)
    kinds: dict[str, int] = {"guess": 0, "slip": 0, "clean": 0}
    for t, e in zip(tasks, await expert_episodes(env, TOK, tasks), strict=True):
        score = env.score(t, e)
        if e.counts.get("tool_calls", 0) == 0:
            kinds["guess"] += 1
            assert not score.correct and e.counts["turns"] == 1
        elif e.counts.get("invalid_tool_call", 0):
            kinds["slip"] += 1
            assert score.correct and e.counts["tool_calls"] == 2 and score.reward == pytest.approx(0.8)
            assert e.tool_log[0].status == "invalid_tool_call" and e.tool_log[1].status == "ok"
        else:
            kinds["clean"] += 1
            assert score.correct and score.reward == 1.0
    assert 0.2 < kinds["guess"] / 400 < 0.4, kinds
    assert 0.3 < kinds["slip"] / (400 - kinds["guess"]) < 0.5, kinds
    again = await expert_episodes(env, TOK, tasks[:20])
    first = await expert_episodes(env, TOK, tasks[:20])
    assert [e.final_text for e in again] == [e.final_text for e in first]


def test_bad_options_are_errors_naming_them() -> None:
    with pytest.raises(EnvError, match="alphabet"):
        get_env("lookup", alphabet="AB")
    with pytest.raises(EnvError, match="max_calls"):
        get_env("lookup", max_calls=0)
    with pytest.raises(EnvError, match="invalid_call_penalty"):
        get_env("lookup", invalid_call_penalty=-1.0)
    with pytest.raises(EnvError, match="expert_slip_rate"):
        get_env("lookup", expert_slip_rate=1.5)
