"""The judge library's pure parts: verdict parsing, rubric files and sampling, aggregation, agreement,
Retry-After, the token bucket, config checks, and how a verdict joins a verifier's score."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import pytest

from slipstream.judge import (
    AGGREGATE,
    JudgeConfig,
    JudgeInput,
    MalformedVerdict,
    RubricError,
    TokenBucket,
    aggregate,
    agreement,
    format_agreement,
    judge_messages,
    load_rubric_sets,
    parse_rubric_sets,
    parse_verdict,
    retry_after_s,
    sample_rubrics,
    select_set,
    with_aggregate,
)
from slipstream.reward_model.config import RewardSection
from slipstream.reward_model.judging import Judges, with_judgement
from slipstream.schemas import Episode, Judgement, ScoredEpisode

pytestmark = pytest.mark.unit

SETS = """
[[rubric_set]]
context = "serve"
version = "v1"
[[rubric_set.rubrics]]
id = "a"
text = "A."
[[rubric_set.rubrics]]
id = "b"
text = "B."
weight = 3
[[rubric_set.rubrics]]
id = "c"
text = "C."
[[rubric_set.rubrics]]
id = "d"
text = "D."

[[rubric_set]]
context = "serve"
version = "v2"
[[rubric_set.rubrics]]
id = "a"
text = "A, reworded."

[[rubric_set]]
context = "coding"
version = "2026-11"
[[rubric_set.rubrics]]
id = "tests"
text = "Tests pass."
"""


# -- verdicts -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("SCORE: 7", 0.7),
        ("The answer is direct.\nIt is short.\nSCORE: 10", 1.0),
        ("reasoning\n  SCORE:0  \n\n", 0.0),
        ("SCORE: 2.5", 0.25),
        ('{"score": 8}', 0.8),
        ('```json\n{"score": 4.5, "why": "partly"}\n```', 0.45),
    ],
)
def test_valid_verdicts_parse_to_scores_in_0_1(text: str, score: float) -> None:
    assert parse_verdict(text) == pytest.approx(score)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "empty answer"),
        ("Looks good.", "is not 'SCORE: <0-10>'"),
        ("SCORE: 7\nHope that helps.", "is not 'SCORE: <0-10>'"),  # the score line must be last
        ("score: 7", "is not 'SCORE: <0-10>'"),
        ("SCORE: 11", "score 11 is outside 0..10"),
        ("SCORE: -1", "score -1 is outside 0..10"),
        ('{"score": NaN}', "score nan is outside 0..10"),
        ('{"score": "9"}', "not a number"),
        ('{"score": true}', "not a number"),
        ('{"verdict": 9}', 'no "score" key'),
        ('{"score": 9', "does not parse"),
    ],
)
def test_malformed_verdicts_name_their_problem(text: str, problem: str) -> None:
    with pytest.raises(MalformedVerdict) as exc:
        parse_verdict(text)
    assert problem in str(exc.value)


def test_judge_messages_show_rubric_task_reference_and_response() -> None:
    msgs = judge_messages("Be brief.", JudgeInput(episode_id="e", response="42", prompt="6*7?", reference="42"))
    assert [m["role"] for m in msgs] == ["system", "user"] and "SCORE: <n>" in msgs[0]["content"]
    assert msgs[1]["content"].startswith("<rubric>\nBe brief.\n</rubric>\n\n<task>\n6*7?\n</task>\n\n<reference>\n42")
    no_prompt = judge_messages("x", JudgeInput(episode_id="e", response="r"))[1]["content"]
    assert "not recorded" in no_prompt and "<reference>" not in no_prompt


def test_judge_input_reads_the_episode() -> None:
    ep = Episode(episode_id="e1", task_id="t", env="serve", final_text="hi", reference="ref", metadata={"prompt": "p"})
    assert JudgeInput.of(ep) == JudgeInput(episode_id="e1", response="hi", prompt="p", reference="ref")


# -- rubric files and sampling ------------------------------------------------------------------------


def test_rubric_files_load_in_toml_and_json(tmp_path: Path) -> None:
    sets = parse_rubric_sets(SETS)
    assert [(s.context, s.version, len(s.rubrics)) for s in sets] == [
        ("serve", "v1", 4),
        ("serve", "v2", 1),
        ("coding", "2026-11", 1),
    ]
    assert sets[0].rubric("b").weight == 3.0 and sets[0].rubric("a").weight == 1.0
    path = tmp_path / "r.json"
    path.write_text('{"rubric_set": [{"context": "x", "version": "1", "rubrics": [{"id": "q", "text": "Q."}]}]}')
    assert load_rubric_sets(path)[0].label == "x@1"


def test_a_context_with_several_versions_needs_one_named() -> None:
    sets = parse_rubric_sets(SETS)
    assert select_set(sets, "serve", "v2").rubrics[0].text == "A, reworded."
    assert select_set(sets, "coding").label == "coding@2026-11"
    with pytest.raises(RubricError, match=r"context 'serve' has versions \['v1', 'v2'\]: name one"):
        select_set(sets, "serve")
    with pytest.raises(RubricError, match=r"no rubric set for context 'chat'; contexts: \['coding', 'serve'\]"):
        select_set(sets, "chat")
    with pytest.raises(RubricError, match="has no version 'v9'"):
        select_set(sets, "serve", "v9")


@pytest.mark.parametrize(
    ("doc", "problem"),
    [
        ('[[rubric_set]]\ncontext = "s"\nversion = "1"\nrubrics = []', "has no rubrics"),
        ('[[rubric_set]]\ncontext = "s"\nversion = "1"\nrubrics = [{id = "a b", text = "x"}]', "rubric id 'a b'"),
        (
            '[[rubric_set]]\ncontext = "s"\nversion = "1"\nrubrics = [{id = "a", text = "x"}, {id = "a", text = "y"}]',
            "'a' appears twice",
        ),
        ('[[rubric_set]]\ncontext = "s"\nversion = "1"\nrubrics = [{id = "a", text = " "}]', "has no text"),
        ('[[rubric_set]]\ncontext = "s"\nversion = "1"\nrubrics = [{id = "a", text = "x", weight = 0}]', "weight"),
        ('[[rubric_set]]\ncontext = "s"\nversion = "1"\nrubrics = [{id = "a", text = "x", mood = 1}]', "mood"),
        ("[[rubric_set]\n", "not valid TOML"),
    ],
)
def test_bad_rubric_files_are_errors_naming_the_problem(doc: str, problem: str) -> None:
    with pytest.raises(RubricError) as exc:
        parse_rubric_sets(doc, source="r.toml")
    assert str(exc.value).startswith("r.toml:") and problem in str(exc.value)


def test_k_of_m_sampling_is_deterministic_per_episode_and_covers_the_set() -> None:
    rs = select_set(parse_rubric_sets(SETS), "serve", "v1")
    picks = {f"ep-{i}": [r.id for r in sample_rubrics(rs, 2, f"ep-{i}")] for i in range(200)}
    assert all(len(p) == 2 and len(set(p)) == 2 for p in picks.values())
    assert picks["ep-7"] == [r.id for r in sample_rubrics(rs, 2, "ep-7")]
    counts = {rid: sum(rid in p for p in picks.values()) for rid in "abcd"}
    assert all(70 <= n <= 130 for n in counts.values()), counts  # each rubric in about half the episodes
    assert [r.id for r in sample_rubrics(rs, 0, "x")] == ["a", "b", "c", "d"]
    assert [r.id for r in sample_rubrics(rs, 9, "x")] == ["a", "b", "c", "d"]


# -- aggregation and agreement ------------------------------------------------------------------------


def test_aggregations_on_hand_computed_numbers() -> None:
    scores = {"a": 0.2, "b": 0.9, "c": 0.4}
    weights = {"a": 1.0, "b": 3.0, "c": 1.0}
    assert aggregate(scores, weights, "mean") == pytest.approx((0.2 + 2.7 + 0.4) / 5)
    assert aggregate(scores, weights, "median") == pytest.approx(0.4)
    assert aggregate(scores, weights, "majority") == 1.0  # b's weight 3 of 5 passes
    assert aggregate(scores, {}, "majority") == 0.0  # unweighted: 1 of 3 passes
    assert aggregate({"a": 0.6, "b": 0.1}, {}, "majority") == 0.5  # a tie
    assert aggregate({"a": 0.6, "b": 0.1}, {}, "majority", pass_threshold=0.05) == 1.0
    with pytest.raises(ValueError, match="no rubric scores"):
        aggregate({}, {}, "mean")
    with pytest.raises(ValueError, match="unknown aggregation 'max'"):
        aggregate(scores, weights, "max")


def test_agreement_finds_the_rubric_that_drifted_from_users() -> None:
    signals: list[float | None] = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, None, 1.0]
    rows = []
    for i, s in enumerate(signals):
        good = 0.9 if s == 1.0 else 0.1
        drift = 0.8 if i % 2 else 0.3  # high when users rejected, except the last episode
        row = {"tracks": good, "drifts": drift}
        if i != 2:
            row["sometimes"] = 0.6
        rows.append(with_aggregate(row, (good + drift) / 2))
    report = {a.rubric_id: a for a in agreement(rows, signals, min_n=5)}
    assert report["tracks"].n == 7 and report["tracks"].correlation == pytest.approx(1.0)
    assert report["tracks"].accuracy == 1.0 and not report["tracks"].drifting
    # Pairs (0.3, 1) x3, (0.8, 0) x3, (0.8, 1): sxy = 1.7 - 4.1 * 4 / 7, sxx = 2.83 - 4.1^2 / 7, syy = 4 - 16 / 7,
    # r = -0.642857 / sqrt(0.428571 * 1.714286) = -0.75; only the last pass/fail matches the user's.
    assert report["drifts"].correlation == pytest.approx(-0.75) and report["drifts"].accuracy == pytest.approx(1 / 7)
    assert report["drifts"].drifting
    assert report["sometimes"].n == 6 and math.isnan(report["sometimes"].correlation) and report["sometimes"].drifting
    assert report[AGGREGATE].n == 7
    ordered = [a.rubric_id for a in agreement(rows, signals, min_n=5)]
    assert ordered[0] == "sometimes" and ordered[-1] == "tracks"  # worst first
    table = format_agreement(agreement(rows, signals, min_n=5))
    assert "DRIFTING" in table and "tracks" in table and "+1.00" in table
    assert not any(a.drifting for a in agreement(rows, signals, min_n=50))  # too little data to call it


# -- limits --------------------------------------------------------------------------------------------


def test_retry_after_in_seconds_milliseconds_and_http_dates() -> None:
    assert retry_after_s({"Retry-After": "3"}) == 3.0
    assert retry_after_s({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    assert retry_after_s({"Retry-After": "Wed, 25 Nov 2026 08:00:10 GMT"}, now=1795593600.0) == pytest.approx(10.0)
    assert retry_after_s({"Retry-After": "soon"}) is None
    assert retry_after_s({"Retry-After": "-4"}) is None
    assert retry_after_s({}) is None


def test_token_bucket_spaces_acquisitions() -> None:
    async def run() -> float:
        bucket = TokenBucket(50.0, burst=2)
        started = time.monotonic()
        for _ in range(6):
            await bucket.acquire()
        return time.monotonic() - started

    # A burst of 2 at once, then 4 more at 50/s: at least 80 ms.
    assert 0.075 <= asyncio.run(run()) < 0.5
    with pytest.raises(ValueError, match="burst >= 1"):
        TokenBucket(1.0, burst=0)


# -- config --------------------------------------------------------------------------------------------


def _judge(**kw: object) -> JudgeConfig:
    base: dict[str, object] = {"url": "http://j/v1", "model": "m", "envs": ["serve"], "rubric_file": "r.toml"}
    base["context"] = "serve"
    return JudgeConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_judge_config_errors_name_the_judge_and_field() -> None:
    with pytest.raises(ValueError, match=r"\[reward.judges.h\] url is empty"):
        _judge(url="").check("h")
    with pytest.raises(ValueError, match=r"\[reward.judges.h\] envs is empty"):
        _judge(envs=[]).check("h")
    with pytest.raises(ValueError, match="min_scored 4 exceeds k 3"):
        _judge(k=3, min_scored=4).check("h")
    section = RewardSection(judges={"h": _judge(), "g": _judge(envs=["arith", "serve"])})
    with pytest.raises(ValueError, match="env 'serve' is claimed by both 'h' and 'g'"):
        section.check_judges()


def test_the_api_key_comes_from_the_named_variable_or_file(tmp_path: Path) -> None:
    assert _judge(api_key_env="JUDGE_KEY").api_key({"JUDGE_KEY": "sk-1"}) == "sk-1"
    with pytest.raises(ValueError, match="api_key_env 'JUDGE_KEY' names an unset or empty variable"):
        _judge(api_key_env="JUDGE_KEY").api_key({})
    (tmp_path / "key").write_text("sk-2\n")
    assert _judge(api_key_file=str(tmp_path / "key")).api_key({}) == "sk-2"
    assert _judge().api_key({}) == "none"


# -- the reward-model's join -------------------------------------------------------------------------


def test_a_verdict_adds_a_weighted_judge_component_or_marks_unscorable() -> None:
    ep = Episode(episode_id="e", task_id="t", env="arith")
    scored = ScoredEpisode(episode=ep, reward=1.1, components={"correct": 1.0, "format": 0.1}, scorer_version="arith@1")
    good = Judgement(judge="h", model="m", rubric_set="arith@v1", rubric_ids=["a"], scores={"a": 0.8}, aggregate=0.8)
    joined = with_judgement(scored, good, weight=0.5)
    assert joined.components == pytest.approx({"correct": 1.0, "format": 0.1, "judge": 0.4})
    assert joined.reward == pytest.approx(1.5) and joined.unscorable == ""
    assert joined.judgements == [good] and joined.scorer_version == "arith@1+h:m:arith@v1"
    bad = Judgement(
        judge="h",
        model="m",
        rubric_set="arith@v1",
        rubric_ids=["a"],
        failures={"a": "timeout"},
        unscorable="judge h: 0 of 1 rubrics scored",
    )
    marked = with_judgement(scored, bad, weight=0.5)
    assert marked.unscorable == "judge h: 0 of 1 rubrics scored" and marked.judgements == [bad]
    assert marked.reward == 1.1 and "judge" not in marked.components


def test_judges_fail_setup_naming_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "r.toml"
    path.write_text(SETS)
    with pytest.raises(ValueError, match=r"\['h'\] cache verdicts in Redis but \[service\] redis_url is empty"):
        Judges.from_config({"h": _judge(rubric_file=str(path), version="v1")}, redis_url="")
    with pytest.raises(RubricError, match=r"rubric file '.*nope\.toml' cannot be read"):
        Judges.from_config({"h": _judge(rubric_file=str(tmp_path / "nope.toml"), cache=False)}, redis_url="")
    with pytest.raises(ValueError, match=r"k 5 exceeds the 4 rubrics of serve@v1"):
        Judges.from_config({"h": _judge(rubric_file=str(path), version="v1", k=5, cache=False)}, redis_url="")
    judges = Judges.from_config({"h": _judge(rubric_file=str(path), version="v1", cache=False)}, redis_url="")
    assert judges.for_env("serve") is judges.judges["h"] and judges.for_env("arith") is None
    asyncio.run(judges.close())


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "libs/judge/rubrics").glob("*.toml")))
def test_the_shipped_rubric_files_load(path: Path) -> None:
    sets = load_rubric_sets(path)
    assert sets and all(len(s.rubrics) >= 3 for s in sets)  # alternatives to sample from
