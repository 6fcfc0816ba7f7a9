"""recall's read-back drill (`Recall.drill_texts`) and the warm-start's `sft_drill_rows` (issue 33).

The micro model warm-started on the learned-summary teacher alone answered "?" to the question of
every clean probe episode (session 29): four in five of the teacher's answers are "?". The drill
teaches the lookup a successful episode ends with, on summaries drawn at random."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from slipstream.engine import build_tiny
from slipstream.envs import get_env
from slipstream.envs.recall import SUMMARY_RESTART, TRUNCATED, UNKNOWN
from slipstream.run.runfile import load
from slipstream.supervised.warmstart import drill_examples, sft_warmstart

PLAN = Path(__file__).resolve().parents[2] / "examples" / "recall_learned.toml"
OPTIONS = dict(facts=3, key_letters="abc", value_chars="0123456789", value_len=2, turns=12, early=6, cue=True)
_RESTART = re.compile(r"^recall ([a-h])\n<summary>(.*?)</summary>\[\d\]\n")


def test_the_drill_answers_from_the_summary_and_only_from_it() -> None:
    env = get_env("recall", **OPTIONS)
    texts = env.drill_texts(400, seed=3)
    assert texts == env.drill_texts(400, seed=3) and texts != env.drill_texts(400, seed=4)
    held = cut = 0
    for context, target in texts:
        m = _RESTART.match(context)
        assert m, context
        asked, summary = m.group(1), dict(f.split("=") for f in m.group(2).split())
        assert context.endswith(f"\n{asked}?\n")
        want = summary.get(asked, UNKNOWN)
        assert target == want + "\n"
        assert all(k in "abc" and re.fullmatch(r"\d\d", v) for k, v in summary.items())
        held += asked in summary
        cut += TRUNCATED in context
    # Both answers and both layouts (straight after the summary, after a truncation) are common.
    assert 0.4 < held / 400 < 0.6 and 0.4 < cut / 400 < 0.6
    assert SUMMARY_RESTART.format(summary="a=01", n=1).startswith("<summary>a=01</summary>[1]")


def test_drill_examples_train_the_answer_alone() -> None:
    env = get_env("recall", **OPTIONS)
    _, tok = build_tiny("micro", seed=0)
    for (ids, trained), (context, target) in zip(drill_examples(env, tok, 20, 5), env.drill_texts(20, 5), strict=True):
        assert ids[0] == tok.bos_id and tok.decode(ids[1:]) == context + target
        assert tok.decode([i for i, t in zip(ids, trained, strict=True) if t]) == target
        assert trained == sorted(trained)  # the context untrained, then the target


def test_an_env_without_a_drill_is_refused_by_name() -> None:
    _, tok = build_tiny("micro", seed=0)
    with pytest.raises(ValueError, match="'reverse' has no skill drill"):
        drill_examples(get_env("reverse"), tok, 4, 0)
    model, tok = build_tiny("micro", seed=0)
    with pytest.raises(ValueError, match="drill_rows must be >= 0"):
        sft_warmstart(model, tok, get_env("recall", **OPTIONS), steps=1, drill_rows=-1)


def test_the_learned_summary_plan_drills_the_read_back() -> None:
    plan = load(PLAN).plan()
    assert plan.sft_drill_rows > 0 and plan.env == "recall"


def test_a_warm_start_mixes_the_drill_into_every_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    from slipstream.supervised import warmstart

    seen: list[int] = []
    real = warmstart._train_step

    def counting(model, opt, sched, rows, pad_id, grad_clip):  # type: ignore[no-untyped-def]
        trained = [tok.decode([i for i, t in zip(ids, m, strict=True) if t]) for ids, m in rows]
        seen.append(sum(1 for text in trained if re.fullmatch(r"(\d\d|\?)\n", text)))
        return real(model, opt, sched, rows, pad_id, grad_clip)

    model, tok = build_tiny("micro", seed=0)
    monkeypatch.setattr(warmstart, "_train_step", counting)
    env = get_env("recall", **OPTIONS)
    figures = sft_warmstart(model, tok, env, steps=3, batch_size=2, drill_rows=2)
    assert figures["steps"] == 3 and len(seen) == 3
    assert seen == [2, 2, 2]  # each batch's two drill rows train an answer alone; the teacher's rows train "ok" too


def test_with_expert_answer_summary_the_drill_reads_the_summarys_first_value_back() -> None:
    env = get_env("recall", **OPTIONS, expert_answer="summary")
    unknown = 0
    for context, target in env.drill_texts(400, seed=3):
        m = _RESTART.match(context)
        assert m, context
        asked, held = m.group(1), [f.split("=") for f in m.group(2).split()]
        summary = dict(held)
        want = summary[asked] if asked in summary else (held[0][1] if held else UNKNOWN)
        assert target == want + "\n"
        unknown += target == UNKNOWN + "\n"
    assert 0 < unknown < 400 * 0.3  # "?" only where the summary is empty
    with pytest.raises(ValueError, match=r"'guess'.*expert_answer"):
        get_env("recall", **OPTIONS, expert_answer="guess")


def test_the_kept_plan_differs_from_the_learned_plan_in_the_teachers_answer_alone() -> None:
    kept, learned = load(PLAN.with_name("recall_kept.toml")).plan(), load(PLAN).plan()
    assert kept.env_options == {**learned.env_options, "expert_answer": "summary"}
    assert msgspec.structs.replace(kept, env_options=learned.env_options) == learned


def test_the_keep_one_plan_differs_from_the_kept_plan_in_the_teachers_summary_alone() -> None:
    one, kept = load(PLAN.with_name("recall_keep_one.toml")).plan(), load(PLAN.with_name("recall_kept.toml")).plan()
    assert one.env_options == {**kept.env_options, "expert_keep": "one"}
    assert kept.env_options["expert_keep"] == "first"
    assert msgspec.structs.replace(one, env_options=kept.env_options) == kept
