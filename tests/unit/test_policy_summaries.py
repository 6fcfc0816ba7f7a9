"""Summaries whose timing and content the policy chooses (issue 33), through the real harness.

The harness's `policy` summaries: the policy opens `<summary>` at a turn of its choice, the harness
lets it finish, restarts the context from it and asks the environment's turn again; a context that
reaches the threshold unsummarised is truncated (keeping the latest summary). `train_summaries=False`
masks the summary tokens from the loss (the control for what RL teaches through them). On `recall`
with a cue, scripted policies show that the outcome needs both the right time and the right fact.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

import msgspec
import pytest

from slipstream.engine import ByteTokenizer, GenerationRequest, SamplingParams
from slipstream.envs import get_env
from slipstream.envs.recall import SUMMARY_END, SUMMARY_REQUEST, SUMMARY_RESTART, Recall
from slipstream.harness import RecordingEngine, SummaryConfig, rollout_episodes, token_problems
from slipstream.rl.credit import token_advantages
from slipstream.schemas import Episode, unpack_ids, unpack_mask
from slipstream.supervised import ScriptedEngine
from slipstream.supervised.warmstart import expert_episodes

pytestmark = pytest.mark.unit

TOK = ByteTokenizer()
OPTIONS = dict(facts=3, key_letters="abc", value_chars="0123456789", turns=12, early=6, cue=True)


def _config(**kw: object) -> SummaryConfig:
    base: dict[str, object] = dict(
        enabled=True, mode="truncate", policy=True, min_tokens=72, max_tokens=96, summary_tokens=24,
        max_summaries=8, request=SUMMARY_REQUEST, restart_template=SUMMARY_RESTART,
    )  # fmt: skip
    return SummaryConfig(**{**base, **kw})  # type: ignore[arg-type]


def _scripted(env: Recall, when: Callable[[object, int], bool], keep: str) -> Callable[..., str]:
    """A policy that summarises (once) at the turns `when(script, turn)` picks, keeping `keep`:
    "asked" (the cued fact, when in view) or "first" (the first fact in view)."""

    def make(task: object) -> Callable[[GenerationRequest, str], str]:
        script = env.script(task)  # type: ignore[arg-type]

        def summary(context: str) -> str:
            seen = env._seen(context)
            if keep == "asked":
                items = [(script.question, seen[script.question])] if script.question in seen else []
            else:
                items = list(seen.items())[:1]
            return SUMMARY_REQUEST + " ".join(f"{k}={v}" for k, v in items) + SUMMARY_END

        def reply(_: GenerationRequest, context: str) -> str:
            head, _, tail = context.rpartition("\n")
            if tail.startswith("<") and SUMMARY_REQUEST.startswith(tail[: len(SUMMARY_REQUEST)]):
                return summary(head)[len(tail) :]  # finishing a summary the engine cut
            question = re.search(r"(?:^|\n)([a-h])\?\n$", context)
            if question:
                return env._seen(context).get(question.group(1), "?") + "\n"
            if SUMMARY_END not in context and when(script, env._turn(task, context)):  # type: ignore[arg-type]
                return summary(context)
            return "ok\n"

        return reply

    return make


async def _play(env: Recall, tasks: list, make: Callable[..., Callable[..., str]], config: SummaryConfig,
                purpose: str = "train") -> list[Episode]:  # fmt: skip
    out = []
    for i, task in enumerate(tasks):
        engine = RecordingEngine(ScriptedEngine(TOK, make(task), max_seq_len=4096))
        params = SamplingParams(temperature=1.0, max_tokens=32)
        episodes = await rollout_episodes(
            engine, TOK, env, task, group_size=1, params=params, group_id=f"g{i}", summary=config,
            purpose=purpose,  # type: ignore[arg-type]
        )  # fmt: skip
        problems = token_problems(episodes[0], engine.calls_of(episodes[0]), TOK)
        if not config.train_summaries and purpose == "train":  # masked on purpose: the one problem allowed
            problems = [p for p in problems if "loss mask marks positions" not in p]
        assert problems == []  # ids made once, by the engine and the tokenizer, never re-encoded
        out.append(episodes[0])
    return out


def _success(env: Recall, tasks: list, episodes: list[Episode]) -> float:
    return sum(env.score(t, e).correct for t, e in zip(tasks, episodes, strict=True)) / len(tasks)


def _asked_turn(script: object) -> int:
    s = script  # a recall Script
    return s.at[[k for k, _ in s.facts].index(s.question)]  # type: ignore[attr-defined]


async def test_a_policy_summary_opens_when_the_policy_chooses_and_the_turn_is_asked_again() -> None:
    env = get_env("recall", **OPTIONS)
    task = env.generate("heldout", 1, 5)[0]
    script = env.script(task)
    at = _asked_turn(script)
    episodes = await _play(
        env, [task], _scripted(env, lambda s, t: t == at, "asked"), _config(min_tokens=400, max_tokens=400)
    )
    episode = episodes[0]
    # One link before the summary, one after; no threshold restart (400 tokens is never reached).
    assert [s.edit for s in episode.samples] == ["", "summary"]
    assert episode.counts["policy_summaries"] == 1 and episode.counts[f"summary_at_turn_{at}"] == 1
    assert not any(k.startswith("threshold_at_turn_") for k in episode.counts)
    first, second = episode.samples
    # The env gave the turn 4 tokens ("ok\n" and its stop): "<sum" was cut there and finished in a second call.
    policy_turns = [t.text for t in first.turns if t.role == "policy"]
    assert policy_turns[-2:] == ["<sum", f"mary>{script.question}={task.reference}</summary>"]
    restart = TOK.decode(unpack_ids(second.token_ids)[: second.prompt_len])
    pending = env.lines(task)[at]
    assert restart == f"recall {script.question}\n<summary>{script.question}={task.reference}</summary>[1]\n{pending}"
    # The turn the summary took is asked again in the new link: the pending line is acknowledged there.
    assert TOK.decode(unpack_ids(second.token_ids)[second.prompt_len :]).startswith("ok\n")
    assert env.score(task, episode).correct


async def test_the_context_size_at_a_policy_summary_is_counted() -> None:
    env = get_env("recall", **OPTIONS)
    task = env.generate("heldout", 1, 5)[0]
    at = _asked_turn(env.script(task))
    episode = (
        await _play(env, [task], _scripted(env, lambda s, t: t == at, "asked"), _config(min_tokens=400, max_tokens=400))
    )[0]
    first = episode.samples[0]
    opened = [t for t in first.turns if t.role == "policy"][-2].start
    assert episode.counts["summary_context_tokens"] == opened


async def test_a_truncation_keeps_the_latest_policy_summary_and_loses_unsummarised_facts() -> None:
    env = get_env("recall", **OPTIONS)
    tasks = env.generate("heldout", 40, 9)
    config = _config()
    never = await _play(env, tasks, _scripted(env, lambda s, t: False, "asked"), config)
    ideal = await _play(env, tasks, _scripted(env, lambda s, t: t == _asked_turn(s), "asked"), config)
    assert _success(env, tasks, never) == 0.0  # every early fact is cut away by the threshold
    assert _success(env, tasks, ideal) == 1.0  # a summary at the right time, of the right fact, survives every cut
    for episode in ideal:
        truncated = [s for s in episode.samples if s.edit == "truncate"]
        assert truncated and episode.counts["truncations"] == len(truncated)
        for link in truncated:
            head = TOK.decode(unpack_ids(link.token_ids)[: link.prompt_len])
            assert re.match(r"recall [abc]\n<summary>[abc]=\d</summary>\[\d+\]\n\n\[truncated\]\n", head), head


async def test_the_outcome_needs_both_the_time_and_the_fact_and_the_teacher_has_neither() -> None:
    base = get_env("recall", **OPTIONS)
    tasks = base.generate("heldout", 120, 11)
    config = _config()
    teacher = get_env("recall", **OPTIONS, expert_self_summary=True, expert_keep="one")
    taught = await asyncio.to_thread(lambda: asyncio.run(expert_episodes(teacher, TOK, tasks, summary=config)))
    # The teacher's own turn for each task, with the right fact: content fixed, timing still the teacher's.
    by_script = {repr(base.script(t)): teacher._when(t) for t in tasks}
    right_fact = await _play(base, tasks, _scripted(base, lambda s, t: t == by_script[repr(s)], "asked"), config)
    right_time = await _play(base, tasks, _scripted(base, lambda s, t: t == _asked_turn(s), "first"), config)
    teacher_rate = _success(teacher, tasks, taught)
    assert 0.08 < teacher_rate < 0.35, teacher_rate
    assert _success(base, tasks, right_fact) < 0.7 and _success(base, tasks, right_time) < 0.7
    # The teacher's timing is uniform over the turns, its content one fact drawn per task.
    metrics = teacher.eval_metrics(tasks, taught)
    assert metrics["summarised"] == 1.0 and 0.15 < metrics["kept_asked"] < 0.55
    shares = [metrics[f"summary_at_turn_{k}"] for k in range(12)]
    assert sum(shares) == pytest.approx(1.0, abs=1e-3) and max(shares) < 0.2


async def test_masked_summaries_have_no_loss_and_no_advantage_in_training_only() -> None:
    env = get_env("recall", **OPTIONS)
    task = env.generate("heldout", 1, 5)[0]
    at = _asked_turn(env.script(task))
    make = _scripted(env, lambda s, t: t == at, "asked")
    config = _config(min_tokens=400, max_tokens=400)
    for purpose, train_summaries, masked in (("train", False, True), ("eval", False, False), ("train", True, False)):
        c = msgspec.structs.replace(config, train_summaries=train_summaries)
        episode = (await _play(env, [task], make, c, purpose=purpose))[0]
        first = episode.samples[0]
        mask = unpack_mask(first.loss_mask)
        advantages = token_advantages(episode, 0.5)[0]
        for turn in first.turns:
            if turn.role != "policy":
                continue
            span = range(turn.start - first.prompt_len, turn.end - first.prompt_len)
            summary = turn.text.startswith("<sum") or turn.text.startswith("mary>")
            want = 0 if (summary and masked) else 1
            assert all(mask[i] == want for i in span), (purpose, train_summaries, turn.text)
            assert all(advantages[i] == (0.5 if want else 0.0) for i in span)


async def test_a_forced_summary_is_masked_too_and_the_threshold_turn_is_counted() -> None:
    env = get_env("recall", **OPTIONS)
    task = env.generate("heldout", 1, 5)[0]
    config = _config(mode="summary", policy=False, train_summaries=False)
    episode = (await _play(env, [task], lambda t: lambda r, c: env.expert(t, c), config))[0]
    assert episode.counts["summaries"] >= 1 and "policy_summaries" not in episode.counts
    assert any(k.startswith("threshold_at_turn_") for k in episode.counts)
    link = episode.samples[0]
    mask = unpack_mask(link.loss_mask)
    written = [t for t in link.turns if t.role == "policy"][-1]
    assert written.text.endswith("</summary>")
    assert all(m == 0 for m in mask[written.start - link.prompt_len : written.end - link.prompt_len])


def test_the_cue_names_the_asked_fact_and_bad_options_are_named() -> None:
    env = get_env("recall", **OPTIONS)
    task = env.generate("train", 1, 0)[0]
    assert task.prompt == f"recall {env.script(task).question}\n"
    assert get_env("recall").generate("train", 1, 0)[0].prompt == "recall\n"
    with pytest.raises(ValueError, match="expert_keep"):
        get_env("recall", expert_keep="some")
    with pytest.raises(ValueError, match="open must not be empty"):
        SummaryConfig(policy=True, open=" ")


def test_the_warm_start_teaches_summaries_even_for_the_masked_control() -> None:
    from slipstream.run.training import _teach_summaries

    masked = _config(train_summaries=False)
    assert _teach_summaries(masked).train_summaries is True
    assert _teach_summaries(None) is None
    assert _teach_summaries(_config()) == _config()


def test_the_arms_set_the_context_mode_and_reach_the_workers() -> None:
    from pathlib import Path

    from slipstream.rollout_worker.config import RolloutWorkerConfig
    from slipstream.run.plan import service_env
    from slipstream.run.presets import with_context
    from slipstream.run.runfile import load
    from slipstream.runtime.config import resolve

    example = Path(__file__).resolve().parents[2] / "examples" / "recall_learned.toml"
    for arm, mode, policy, trained in (
        ("policy", "truncate", True, True),
        ("masked", "truncate", True, False),
        ("truncate", "truncate", False, True),
        ("summary", "summary", False, True),
    ):
        plan = with_context(load(example).plan(), arm)
        worker = resolve(RolloutWorkerConfig, environ=service_env(plan, Path("/m"), Path("/s"), Path("/o")))
        s = worker.summary
        assert (s.mode, s.policy, s.train_summaries) == (mode, policy, trained), arm
        assert (s.min_tokens, s.max_tokens, s.summary_tokens) == (72, 96, 24)  # the same budget in every arm
    with pytest.raises(ValueError, match="context must be one of"):
        with_context(load(example).plan(), "sometimes")


async def test_the_rollout_workers_sampler_plays_policy_summaries_from_its_summary_section() -> None:
    from slipstream.rollout_worker.config import RolloutWorkerConfig
    from slipstream.rollout_worker.sampler import Sampler
    from slipstream.runtime.config import resolve

    options = {**OPTIONS, "expert_self_summary": True, "expert_keep": "one"}
    env = get_env("recall", **options)
    spec = env.generate("train", 1, 4)[0]
    task = spec.to_task(run_id="r", group_size=2)
    environ = {
        "SLIPSTREAM_SUMMARY__ENABLED": "true",
        "SLIPSTREAM_SUMMARY__MODE": "truncate",
        "SLIPSTREAM_SUMMARY__POLICY": "true",
        "SLIPSTREAM_SUMMARY__TRAIN_SUMMARIES": "false",
        "SLIPSTREAM_SUMMARY__MIN_TOKENS": "72",
        "SLIPSTREAM_SUMMARY__MAX_TOKENS": "96",
        "SLIPSTREAM_SUMMARY__SUMMARY_TOKENS": "24",
        "SLIPSTREAM_SUMMARY__REQUEST": SUMMARY_REQUEST,
        "SLIPSTREAM_SUMMARY__RESTART_TEMPLATE": SUMMARY_RESTART,
        "SLIPSTREAM_WORKER__MAX_TOKENS": "32",
        "SLIPSTREAM_WORKER__ENV_OPTIONS": msgspec.json.encode({"recall": options}).decode(),
    }
    cfg = resolve(RolloutWorkerConfig, environ=environ)
    assert cfg.summary.policy and not cfg.summary.train_summaries
    engine = ScriptedEngine(TOK, lambda _r, context: env.expert(spec, context), max_seq_len=4096)
    sampler = Sampler(engine, TOK, cfg.worker, worker_id="w", run_id="r", summary=cfg.summary)
    episodes = await sampler.sample(task)
    for episode in episodes:
        assert episode.counts["policy_summaries"] == 1  # the teacher's own summary, at its drawn turn
        assert episode.counts[f"summary_at_turn_{env._when(spec)}"] == 1
        summarised = next(s for s in episode.samples if any(t.text == "<sum" for t in s.turns))
        mask = unpack_mask(summarised.loss_mask)
        opened = next(t for t in summarised.turns if t.text == "<sum")
        assert not any(mask[opened.start - summarised.prompt_len :])  # masked in training: the control


@pytest.mark.parametrize("keep", ["first", "last"])
async def test_a_triggered_teacher_summarises_at_a_cue_it_can_see_and_keeps_the_first_or_last_fact(keep: str) -> None:
    teacher = get_env("recall", **OPTIONS, expert_self_summary=True, expert_trigger="pqr", expert_keep=keep)
    tasks = teacher.generate("heldout", 60, 13)
    episodes = await asyncio.to_thread(lambda: asyncio.run(expert_episodes(teacher, TOK, tasks, summary=_config())))
    for task, episode in zip(tasks, episodes, strict=True):
        lines = teacher.lines(task)
        cues = [t for t, line in enumerate(lines) if line[0] == "~" and line[1] in "pqr"]
        turns = [int(k.rpartition("_")[2]) for k in episode.counts if k.startswith("summary_at_turn_")]
        if not cues:  # no cue line (nor any truncation before one): the teacher never summarises
            assert turns == []
            continue
        assert turns == [cues[0]] or "truncations" in episode.counts
        first = next(s for s in episode.samples if any(t.text == "<sum" for t in s.turns))
        context = TOK.decode(unpack_ids(first.token_ids))
        shown = re.findall(r"(?<![a-z])([a-c])=(\d)", context[: context.index("<sum")])
        written = re.search(r"<summary>(.*?)</summary>", "".join(t.text for t in first.turns if t.role == "policy"))
        assert written is not None
        kept = (shown[0] if keep == "first" else shown[-1]) if shown else None
        assert written.group(1) == (f"{kept[0]}={kept[1]}" if kept else "")
    # The same rule, played twice, gives the same episodes (a model can replay it greedily).
    again = await asyncio.to_thread(lambda: asyncio.run(expert_episodes(teacher, TOK, tasks, summary=_config())))
    assert [unpack_ids(e.samples[-1].token_ids) for e in again] == [
        unpack_ids(e.samples[-1].token_ids) for e in episodes
    ]
    rate = _success(teacher, tasks, episodes)
    assert 0.08 < rate < 0.4, rate  # the teacher rarely keeps the asked fact at the right time


async def test_a_strict_ack_ends_the_episode_when_the_policy_writes_anything_but_ok() -> None:
    # The hack RL found on the first seeds of this plan: echo the remembered value in every
    # acknowledgement, so that truncation keeps it, and answer from there (no summary needed).
    for strict, want in ((False, True), (True, False)):
        env = get_env("recall", **OPTIONS, strict_ack=strict)
        task = env.generate("heldout", 1, 5)[0]

        def make(t: object, env: Recall = env) -> Callable[..., str]:
            def reply(_: GenerationRequest, context: str) -> str:
                return env.script(t).answer + "\n"  # type: ignore[arg-type]  (every ack and the answer: the value)

            return reply

        episode = (await _play(env, [task], make, _config(policy=False)))[0]
        assert env.score(task, episode).correct is want
        assert ("bad_ack" in episode.counts) is strict


async def test_a_teacher_that_reads_its_summary_back_answers_its_value_where_the_lookup_says_unknown() -> None:
    options = {**OPTIONS, "value_len": 2, "expert_self_summary": True, "expert_trigger": "pqr", "expert_keep": "first"}
    lookup, reads = get_env("recall", **options), get_env("recall", **options, expert_answer="summary")
    tasks = lookup.generate("heldout", 80, 17)

    def play(env: Recall) -> list[Episode]:
        return asyncio.run(expert_episodes(env, TOK, tasks, summary=_config()))

    a, b = await asyncio.to_thread(play, lookup), await asyncio.to_thread(play, reads)
    changed = 0
    for task, x, y in zip(tasks, a, b, strict=True):
        ids_x, ids_y = unpack_ids(x.samples[-1].token_ids), unpack_ids(y.samples[-1].token_ids)
        answer_x, answer_y = x.samples[-1].turns[-1].text, y.samples[-1].turns[-1].text
        assert ids_x[: len(ids_x) - len(TOK.encode(answer_x))] == ids_y[: len(ids_y) - len(TOK.encode(answer_y))]
        if answer_x != answer_y:  # only where the lookup gave up and a summary held another fact
            changed += 1
            assert answer_x == "?\n" and answer_y != "?\n" and answer_y != lookup.script(task).answer + "\n"
        context = TOK.decode(ids_y)
        held = re.findall(r"<summary>[a-c]=(\d\d)", context)
        if held and answer_y != lookup.script(task).answer + "\n":
            assert answer_y == held[-1] + "\n"  # read back from the latest summary, even a wrong fact
        assert (answer_y == "?\n") == (not held and answer_y != lookup.script(task).answer + "\n")
    # A quarter of the tasks: the rest were answered right, or summarised before any fact arrived.
    assert changed > 0.2 * len(tasks)
    assert _success(lookup, tasks, a) == _success(reads, tasks, b)  # what decides success is what was kept
    metrics = reads.eval_metrics(tasks, b)
    assert metrics["kept_value"] >= metrics["kept_asked"] > 0
