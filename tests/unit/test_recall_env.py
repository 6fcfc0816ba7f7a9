"""The `recall` env: facts over many turns, a question at the end, played through the real harness.

Its scripted expert reads only what is in its context, so what it answers shows what a context
mode kept: the whole episode, a self-summarised chain, or the truncation baseline.
"""

from __future__ import annotations

import asyncio

import pytest

from slipstream.engine import ByteTokenizer, SamplingParams
from slipstream.envs import get_env
from slipstream.envs.recall import SUMMARY_REQUEST, SUMMARY_RESTART, Recall, parse_key
from slipstream.harness import SummaryConfig, rollout_episodes
from slipstream.supervised import ScriptedEngine
from slipstream.supervised.warmstart import expert_episodes

pytestmark = pytest.mark.unit

TOK = ByteTokenizer()


def _config(mode: str) -> SummaryConfig:
    return SummaryConfig(
        enabled=True,
        mode=mode,  # type: ignore[arg-type]
        min_tokens=56,
        max_tokens=80,
        summary_tokens=24,
        request=SUMMARY_REQUEST,
        restart_template=SUMMARY_RESTART,
    )


def _success(env: Recall, config: SummaryConfig | None, n: int = 64) -> float:
    tasks = env.generate("train", n, 3)
    episodes = asyncio.run(expert_episodes(env, TOK, tasks, summary=config))
    return sum(env.score(t, e).correct for t, e in zip(tasks, episodes, strict=True)) / n


def test_an_episode_shows_every_line_then_asks_about_a_fact() -> None:
    env = get_env("recall", facts=2, turns=6)
    task = env.generate("train", 1, 0)[0]
    script = parse_key(task.metadata["key"])
    lines = env.lines(task)
    assert len(lines) == 6 and sum("=" in line for line in lines) == 2
    assert [lines[t] for t in script.at] == [f"{k}={v}\n" for k, v in script.facts]
    assert task.reference == dict(script.facts)[script.question]
    episode = asyncio.run(expert_episodes(env, TOK, [task]))[0]
    sample = episode.samples[0]
    text = TOK.decode(sample.ids())
    assert text == "recall\n" + "".join(line + "ok\n" for line in lines) + f"{script.question}?\n{task.reference}\n"
    assert env.score(task, episode).correct


def test_the_expert_answers_from_the_full_context_and_from_its_summaries_but_not_after_truncation() -> None:
    env = get_env("recall")
    assert _success(env, None) == 1.0
    assert _success(env, _config("summary")) == 1.0  # a perfect teacher's summaries carry the fact
    truncated = _success(env, _config("truncate"))
    assert 0.05 < truncated < 0.6  # only facts that arrived after the last cut survive


def test_an_imperfect_teacher_drops_facts_from_its_summaries() -> None:
    perfect = _success(get_env("recall"), _config("summary"))
    sloppy = _success(get_env("recall", expert_drop_rate=0.5), _config("summary"))
    assert sloppy < perfect - 0.15


def test_summaries_restart_the_context_with_the_fact() -> None:
    env = get_env("recall", early=2)  # the fact arrives in the first two turns: every summary must carry it
    task = env.generate("train", 1, 1)[0]
    episodes = asyncio.run(expert_episodes(env, TOK, [task], summary=_config("summary")))
    episode = episodes[0]
    assert len(episode.samples) >= 2 and episode.counts["summaries"] == len(episode.samples) - 1
    for k, link in enumerate(episode.samples[1:], start=1):
        text = TOK.decode(link.ids())
        assert text.startswith("recall\n<summary>")
        assert f"={task.reference}</summary>[{k}]\n" in text
    assert env.score(task, episode).correct


def test_the_group_threshold_is_shared_by_a_groups_episodes() -> None:
    env = get_env("recall")
    task = env.generate("train", 1, 2)[0]

    def reply(_request: object, context: str) -> str:
        return env.expert(task, context)

    params = SamplingParams(temperature=1.0, max_tokens=64)
    episodes = asyncio.run(
        rollout_episodes(
            ScriptedEngine(TOK, reply), TOK, env, task, group_size=3, params=params, summary=_config("truncate")
        )
    )
    assert len({len(e.samples) for e in episodes}) == 1


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"facts": 0}, "facts must be in"),
        ({"turns": 0}, "turns must be in"),
        ({"early": 1, "facts": 2}, "early must be 0 or in"),
        ({"key_letters": "xyz"}, "key_letters must be distinct letters"),
        ({"facts": 2, "key_letters": "a"}, "need at least facts=2 key_letters"),
        ({"value_chars": "abc"}, "value_chars must be uppercase letters or digits"),
        ({"value_len": 4}, "value_len must be in 1..3"),
        ({"expert_drop_rate": 2.0}, "expert_drop_rate must be in"),
    ],
)
def test_bad_options_name_the_option(options: dict, words: str) -> None:
    with pytest.raises(Exception, match=words):
        get_env("recall", **options)


def test_a_bad_key_is_named() -> None:
    with pytest.raises(ValueError, match="not a recall key: 'zz'"):
        parse_key("zz")
    with pytest.raises(ValueError, match="one turn per fact"):
        parse_key("aQ.bR|1|a|0001")
