"""Issue 32, items 3-6: what makes the swarm's result earnable rather than built in.

- a single agent in its own right: mode `single` has its own prompt (the `[single]` token a
  byte-level model sees), its own serial teacher, and the demo trains it as its own arm with the
  same steps, samples and budget;
- a warm-start without the behaviour: the per-item teacher works serially with the swarm tools
  (one sub-agent per item, one item a turn) and is parallel on about `expert_parallel_rate` of the
  tasks; λ can be set, 0 included (the ablation);
- tasks where parallelism pays: item counts {2, 4, 8}, and held-out tasks whose documents never
  occur in train;
- latency (the episode's wall clock) and the parallel rate in the evaluation's metrics, and the
  accuracy-vs-budget curve's budgets and plot.

Episodes run through the real harness with the scripted engine (test_swarm_env's `play`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from pathlib import Path

import msgspec
import pytest
from test_swarm_env import call, env, play

from slipstream.envs import get_env
from slipstream.envs.swarm import tasks as tk
from slipstream.envs.swarm.expert import parallel
from slipstream.learner.config import LearnerConfig
from slipstream.run import service_env, swarm_demo, swarm_eval
from slipstream.run.presets import demo_plan
from slipstream.runtime.config import resolve

pytestmark = pytest.mark.unit

SWARM = "assign_task"


def test_single_mode_has_its_own_prompt_over_the_same_items() -> None:
    swarm, single = env(wide_min=3, wide_max=3), env(mode="single", wide_min=3, wide_max=3)
    for split in ("train", "heldout"):
        a, b = swarm.generate(split, 6, seed=1), single.generate(split, 6, seed=1)
        for x, y in zip(a, b, strict=True):
            assert x.metadata == y.metadata and x.reference == y.reference  # the same items, the same answer
            assert y.prompt == tk.SINGLE_TAG + x.prompt and not x.prompt.startswith("[")
    # the tag also leads the fixed layout's prompt, which otherwise keeps its line widths
    fixed = {"fixed_offsets": True, "expert_grep": True}
    one = env(fixed, layout="fixed", mode="single", wide_min=2, wide_max=2).generate("train", 1, seed=0)[0]
    assert one.prompt.startswith(tk.SINGLE_TAG + tk.HEADER)


async def test_the_single_teacher_searches_directly_one_call_a_turn() -> None:
    e = env({"expert_grep": True}, mode="single", max_critical_steps=10, wide_min=4, wide_max=4)
    for t in e.generate("train", 3, seed=0):
        ep = await play(e, t, None)
        assert ep.counts["subagents"] == 0 and ep.counts["parallel_turns"] == 0
        assert ep.counts["critical_steps"] == ep.counts["total_steps"] == 4 + 1  # 4 greps, the answer
        assert e.score(t, ep).correct and not any(ev.name == SWARM for ev in ep.tool_log)


async def test_the_per_item_teacher_works_serially_with_one_sub_agent_per_item() -> None:
    e = env(
        {"expert_grep": True},
        max_critical_steps=30,
        item_counts=[4],
        max_subagents=8,
        expert_subagents="per_item",
        expert_parallel_rate=0.0,
    )
    t = e.generate("train", 1, seed=0)[0]
    ep = await play(e, t, None)
    # four turns, each creating one agent and assigning it one item, then the answer: one
    # sub-agent a turn, so the critical steps are the work
    assigns = [ev for ev in ep.tool_log if ev.name == SWARM]
    assert len(assigns) == 4 and len({ev.turn for ev in assigns}) == 4
    assert ep.counts["critical_steps"] == ep.counts["total_steps"] and ep.counts["parallel_turns"] == 0
    assert ep.counts["subagents"] == ep.counts["parallel_agents"] == ep.counts["subagents_created"] == 4
    s = e.score(t, ep)
    assert s.correct and s.components["parallel"] == 1.0
    assert e.eval_metrics([t], [ep])["parallel_rate"] == 0.0
    # a tight budget: one item a turn until one more would leave no step for the answer
    tight = env(
        {"expert_grep": True}, max_critical_steps=7, item_counts=[4], max_subagents=8, expert_subagents="per_item"
    )
    part = await play(tight, t, None)
    n = part.counts["subagents"]
    assert part.finish_reason == "stop" and 1 <= n < 4 and part.counts["critical_steps"] <= 7
    assert tight.score(t, part).components["perf"] == n / 4


@pytest.mark.parametrize("order", ["listed", "last_first"])
async def test_the_serial_teachers_first_brief_sits_one_distance_before_its_copy_for_every_n_when_last_first(
    order: str,
) -> None:
    # With the plan's budget of 4 a serial episode is one turn assigning one item. Which item, and
    # so how far its brief sits before the copy the orchestrator writes, is the teacher's choice:
    # the prompt's last line is one distance away for every item count, the first line's grows with N.
    distances = {}
    for n in (2, 4, 8):
        # the copying plan (before references): the assignment holds the brief itself
        plan = {**demo_plan("swarm").env_options, "item_counts": [n], "expert_parallel_rate": 0.0}
        plan.update(by_reference=False, layout="fixed", train_budgets=[])
        e = get_env("swarm", **plan, expert_serial_order=order)
        t = e.generate("train", 1, seed=0)[0]
        ep = await play(e, t, None)
        assert len([ev for ev in ep.tool_log if ev.name == SWARM]) == 1
        text = bytes(i for i in ep.samples[0].ids() if i < 256).decode()
        (brief,) = re.findall(r'"name": "assign_task", "args": \{"agent": "a", "prompt": "([^"]+)"', text)
        items = tk.items_of(t.metadata)
        assert brief == (items[-1] if order == "last_first" else items[0]).question
        source = text.index(brief)
        distances[n] = text.index(brief, source + 1) - source
    if order == "last_first":
        assert len(set(distances.values())) == 1, distances
    else:
        assert distances[2] < distances[4] < distances[8], distances


async def test_the_per_item_teacher_is_parallel_on_its_share_and_the_rate_is_measured() -> None:
    e = env(
        {"expert_grep": True},
        max_critical_steps=4,
        item_counts=[2, 4],
        max_subagents=4,
        expert_subagents="per_item",
        expert_parallel_rate=0.1,
    )
    tasks = e.generate("train", 200, seed=0)
    share = sum(parallel(e.options, t) for t in tasks) / len(tasks)
    assert 0.03 <= share <= 0.17  # 200 draws of a 0.1 rate
    par = next(t for t in tasks if parallel(e.options, t))
    ser = next(t for t in tasks if not parallel(e.options, t))
    episodes = [await play(e, par, None), await play(e, ser, None)]
    n = len(tk.items_of(par.metadata))
    p = episodes[0]
    # one turn creating N agents and assigning one item each (1 + 2), then the answer
    assert p.counts["critical_steps"] == 4 and p.counts["parallel_turns"] == 1 and p.counts["parallel_agents"] == n
    assert e.score(par, p).correct
    assert episodes[1].counts["parallel_turns"] == 0 and episodes[1].counts["subagents"] == 1
    m = e.eval_metrics([par, ser], episodes)
    assert m["parallel_rate"] == 0.5 and m["subagents"] == (n + 1) / 2
    assert m["latency_s"] == pytest.approx(sum(ep.counts["wall_ms"] for ep in episodes) / 2000)
    assert all(ep.counts["wall_ms"] >= 0 for ep in episodes) and m["latency_s"] > 0


def test_item_counts_draw_every_listed_n() -> None:
    e = env(item_counts=[2, 4, 8])
    counts = [len(tk.items_of(t.metadata)) for t in e.generate("train", 60, seed=3)]
    assert set(counts) == {2, 4, 8}
    with pytest.raises(ValueError, match="item_counts"):
        env(item_counts=[0, 4])
    with pytest.raises(ValueError, match="max_subagents 4 is below the largest item count 8"):
        env(item_counts=[8], expert_subagents="per_item")


def test_unseen_heldout_items_never_occur_in_train() -> None:
    # unique clues (as the demo's corpus): a question names one document, so it is held out with it
    unique = {"tasks_per_domain": 48, "unique_clues": True, "regions": 12, "min_year": 1000}
    e = env(unique, heldout_items="unseen", item_counts=[2, 4], heldout_one_in=4)
    train, held = e.generate("train", 300, seed=0), e.generate("heldout", 60, seed=0)
    docs = {s: {d for t in ts for d in t.reference.split()} for s, ts in (("train", train), ("heldout", held))}
    items = {s: [it for t in ts for it in tk.items_of(t.metadata)] for s, ts in (("train", train), ("heldout", held))}
    keys = {s: {it.key for it in its} for s, its in items.items()}
    questions = {s: {it.question for it in its} for s, its in items.items()}
    assert docs["heldout"] and keys["heldout"] and len(keys["train"]) > len(keys["heldout"])
    assert not docs["train"] & docs["heldout"]  # no held-out document (entity) occurs in train
    assert not keys["train"] & keys["heldout"] and not questions["train"] & questions["heldout"]
    # not even in the whole train item pool, nor in any document a train item needs
    pool = {d for t in e.split_pools["train"]["wide"] for d in t.targets}
    assert not pool & docs["heldout"]
    assert all(e.split_of(t.metadata["key"]) == "heldout" for t in held)
    assert all(e.split_of(t.metadata["key"]) == "train" for t in train)
    # the default split: new combinations of items that train tasks also use
    combos = env({"tasks_per_domain": 48}, item_counts=[2, 4], heldout_one_in=4)
    a, b = combos.generate("train", 300, seed=0), combos.generate("heldout", 60, seed=0)
    assert {d for t in a for d in t.reference.split()} & {d for t in b for d in t.reference.split()}


def test_the_demo_plan_starts_without_the_behaviour_and_pays_for_parallelism() -> None:
    plan = demo_plan("swarm")
    o = get_env("swarm", **plan.env_options).options
    assert o.item_counts == [2, 4, 8] and o.heldout_items == "unseen"
    assert o.expert_subagents == "per_item" and o.expert_parallel_rate <= 0.1
    # parallel (create + assign all, a sub-agent's 2, the answer) fits the budget at every N;
    # a serial single agent (N greps + the answer) only at N = 2; a serial swarm (3 a turn) never
    assert 1 + 2 + 1 <= o.max_critical_steps < min(n + 1 for n in o.item_counts if n >= 4)
    assert o.max_subagents >= 8 and plan.max_tokens >= o.turn_tokens and o.max_turns >= max(o.item_counts) + 2


def test_the_single_arm_is_the_same_budget_of_steps_and_samples_in_its_own_mode() -> None:
    plan = demo_plan("swarm")
    single, swarm = swarm_demo.arm_plan(plan, "single"), swarm_demo.arm_plan(plan, "swarm")
    assert single.env_options["mode"] == "single" and swarm.env_options["mode"] == "swarm"
    same = ("max_steps", "group_size", "groups_per_step", "sft_steps", "sft_batch", "temperature", "max_tokens")
    assert all(getattr(single, f) == getattr(swarm, f) == getattr(plan, f) for f in same)
    assert {k: v for k, v in single.env_options.items() if k != "mode"} == {
        k: v for k, v in swarm.env_options.items() if k != "mode"
    }
    with pytest.raises(ValueError, match="swarm arm"):
        swarm_demo.arm_plan(plan, "both")


def test_lambda_zero_is_the_ablation_and_reaches_the_learner() -> None:
    plan = demo_plan("swarm")
    assert swarm_demo.arm_plan(plan, "swarm").reward_schedule == plan.reward_schedule
    zero = swarm_demo.arm_plan(plan, "swarm", 0.0)
    assert swarm_demo.arm_name("swarm", 0.0) == "swarm-lambda0" and swarm_demo.arm_name("swarm", None) == "swarm"
    learner = resolve(LearnerConfig, environ=service_env(zero, Path("/m"), Path("/s"), Path("/o")))
    for name in ("parallel", "finish"):
        s = learner.learner.reward_schedule[name]
        assert (s.init, s.final) == (0.0, 0.0)
    half = swarm_demo.arm_plan(plan, "swarm", 0.5)
    assert half.reward_schedule["parallel"]["init"] == 0.5 and half.reward_schedule["parallel"]["final"] == 0.0
    with pytest.raises(ValueError, match="swarm-lambda"):
        swarm_demo.arm_plan(plan, "swarm", -1.0)


def test_the_demo_flags_parse() -> None:
    from slipstream.cli.demo import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["demo", "--env", "swarm", "--swarm-arm", "single", "--swarm-lambda", "0"])
    assert (args.swarm_arm, args.swarm_lambda, args.swarm_budget_tasks) == ("single", 0.0, swarm_demo.BUDGET_TASKS)
    assert swarm_demo._ints("2,4,8", "--swarm-items") == [2, 4, 8]
    with pytest.raises(SystemExit):
        swarm_demo._ints("2,x", "--swarm-items")


def test_the_budget_curve_spans_two_to_n_plus_two_and_its_plot_says_what_it_shows(tmp_path: Path) -> None:
    assert swarm_eval.budgets(4) == [2, 3, 4, 5, 6] and swarm_eval.budgets(8) == list(range(2, 11))
    with pytest.raises(ValueError, match="item count"):
        swarm_eval.budgets(0)

    def curve(acc: list[float], version: int | None) -> dict[str, object]:
        return {
            "tasks": 16,
            "samples": 1,
            "version": version,
            "curves": {"4": [{"budget": b, "accuracy": a} for b, a in zip(swarm_eval.budgets(4), acc, strict=True)]},
        }

    curves = {"swarm": curve([0, 0, 0.5, 0.5, 0.6], 12), "single": curve([0, 0, 0, 0.7, 0.8], None)}
    fig = swarm_eval.budget_figure(curves)
    (ax,) = fig.axes
    assert ax.get_xlabel() == "critical-step budget B" and "held-out accuracy" in ax.get_ylabel()
    assert "against the critical-step budget" in fig._suptitle.get_text()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "swarm (v12)" in labels and "single (warm-start)" in labels
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in ax.get_lines()}
    assert lines["single (warm-start)"] == [0, 0, 0, 0.7, 0.8]
    png = swarm_eval.plot_budget(curves, tmp_path / "b.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.dumps(curves)  # what the demo writes as swarm-budget.json


async def test_at_budget_n_plus_1_the_serial_teacher_finishes_and_below_it_does_not() -> None:
    from test_swarm_env import SEARCH

    opts = {"search": {**SEARCH, "expert_grep": True}, "item_counts": [2, 4]}
    single = swarm_eval.ArmModel(mode="single", env_options=opts, model_dir=Path("/m"))
    for n in (6, 8):  # past the option's default of 8 turns
        fits, short = swarm_eval.budget_env(single, n, n + 1), swarm_eval.budget_env(single, n, n)
        t = fits.generate("heldout", 1, seed=0)[0]
        ep = await play(fits, t, None)
        # (this test corpus's grep may find two items' documents at once: at most N + 1 steps)
        assert fits.score(t, ep).correct and ep.counts["critical_steps"] <= n + 1 <= fits.options.max_turns - 1
        cut = await play(short, short.generate("heldout", 1, seed=0)[0], None)
        assert cut.finish_reason == "stop" and cut.counts["critical_steps"] <= n
    swarm = swarm_eval.ArmModel(mode="swarm", env_options=opts, model_dir=Path("/m"))
    o = swarm_eval.budget_env(swarm, 8, 4).options
    assert (o.item_counts, o.max_critical_steps, o.max_subagents, o.max_assign_per_turn) == ([8], 4, 8, 8)


def test_the_table_compares_each_arm_in_its_own_mode() -> None:
    from rich.console import Console

    row = {"accuracy": 0.5, "parallel_rate": 0.05, "latency_s": 1.25}
    report = {
        "arms": ["single", "swarm"],
        "after/swarm/heldout": row,
        "after/single/heldout": {**row, "accuracy": 0.75},
    }
    console = Console(record=True, width=220)
    console.print(swarm_demo.table(report))
    text = console.export_text()
    single = next(x for x in text.splitlines() if "after" in x and "heldout" in x and "single" in x)
    assert "0.750" in single and "1.250" in single
    arm = swarm_eval.ArmModel(mode="single", env_options=demo_plan("swarm").env_options, model_dir=Path("/m"))
    task = swarm_eval._env(arm).generate("heldout", 1, seed=0)[0]
    assert task.prompt.startswith(tk.SINGLE_TAG)  # the single arm is evaluated in its own mode


def test_the_report_takes_latency_and_the_parallel_rate_from_the_stack(tmp_path: Path) -> None:
    from slipstream.run.training import RunSummary

    before = {"accuracy": 0.0, "parallel_rate": 0.125, "latency_s": 2.5, "malformed_calls": 1.0}
    summary = RunSummary(
        ok=True,
        plan=demo_plan("swarm"),
        run_dir=str(tmp_path),
        steps=3,
        heldout_metrics_before=before,
        heldout_metrics_after={**before, "latency_s": 1.75},
        warmstart={"steps": 250, "cached": "abc", "probe_curve": [[1, 0.0]]},
        trajectories={"published": 40, "trained": 24, "dropped": {"uniform_group": 16}, "scored": 40},
    )
    figures = swarm_demo.stack_figures(summary)
    # the arm's sample budget: what it drew, what trained, what was dropped and why
    assert figures["samples"] == {"sampled": 40, "trained": 24, "dropped": {"uniform_group": 16}}
    assert figures["heldout_before"] == {"accuracy": 0.0, "parallel_rate": 0.125, "latency_s": 2.5}
    assert figures["heldout_after"]["latency_s"] == 1.75 and figures["steps"] == 3
    assert figures["warmstart"] == {"steps": 250, "cached": "abc"}  # scalars only


def test_the_warm_start_probe_replays_the_serial_teachers_partial_answers() -> None:
    # At the demo's budget of 4 a serial teacher answers one item of N (never `correct`): a probe of
    # correct episodes only held the rare parallel ones, the behaviour the warm-start must not hold,
    # so it could never stop a warm-start early (session 25: 8,000 steps, probe 0.000).
    from slipstream.engine.tokenizer import ByteTokenizer
    from slipstream.supervised.warmstart import probe_items

    e = get_env("swarm", **{**demo_plan("swarm").env_options, "item_counts": [2, 4], "expert_parallel_rate": 0.0})
    tasks = e.generate("train", 6, seed=0)
    items = probe_items(e, ByteTokenizer(), tasks)
    assert len(items) == 6  # every serial episode: one item answered right, every call well formed
    tok = ByteTokenizer()
    answer = tok.decode(items[0][0][0])
    assert "<docs>" in answer and "assign_task" in answer
    # a wrong id in the answer, or an unfinished assignment, is not a clean episode
    (t,) = e.generate("train", 1, seed=1)
    ep = asyncio.run(play(e, t, None))
    assert e.probe_episode(t, ep)
    assert not e.probe_episode(t, msgspec.structs.replace(ep, final_text="<docs>999</docs>"))
    assert not e.probe_episode(t, msgspec.structs.replace(ep, counts={**ep.counts, "subagents_finished": 0}))


@pytest.mark.parametrize("rate", [1.0, 0.0])
async def test_by_reference_the_teacher_names_items_and_sub_agents_and_copies_no_brief(rate: float) -> None:
    # The demo plan's orchestrator refers to an item by its number and to a sub-agent's result by
    # the sub-agent's name, so none of its bytes copies a brief or an id (README, "swarm").
    plan = {**demo_plan("swarm").env_options, "item_counts": [4], "expert_parallel_rate": rate, "cite": "names"}
    assert plan["by_reference"] is True
    e = get_env("swarm", **plan)
    t = e.generate("heldout", 1, seed=0)[0]
    ep = await play(e, t, None)
    orchestrator = next(s for s in ep.samples if s.role == "policy")
    text = bytes(i for i in orchestrator.ids() if i < 256).decode()
    items = tk.items_of(t.metadata)
    assert all(text.count(it.question) == 1 for it in items)  # each brief once: in the prompt
    numbers = re.findall(r'"name": "assign_task", "args": \{"agent": "\w", "prompt": "(\d+)"', text)
    n = 4 if rate else 1  # parallel: every item in one turn; serial: the budget of 4 leaves one turn
    assert numbers == [str(i + 1) for i in range(n)]
    subs = [s for s in ep.samples if s.role == "subagent"]
    asked = [bytes(i for i in s.ids() if i < 256).decode() for s in subs]
    assert all(any(it.question in a for a in asked) for it in items[:n])  # each sub-agent got its brief
    raw = text.rsplit("\n", 2)[-2] if text.endswith("\n") else text.rsplit("\n", 1)[-1]
    assert raw == "<docs>" + " ".join("abcd"[:n]) + "</docs>"  # the answer as the model wrote it
    assert ep.final_text.strip() == "<docs>" + " ".join(it.targets[0] for it in items[:n]) + "</docs>"
    s = e.score(t, ep)
    assert s.components["perf"] == n / 4 and s.correct == (n == 4)
    assert e.probe_episode(t, ep)


async def test_by_reference_an_out_of_range_item_is_refused_and_a_name_stands_only_for_what_it_returned() -> None:
    e = env({"expert_grep": True}, item_counts=[2], max_critical_steps=10, by_reference=True)
    t = e.generate("train", 1, seed=0)[0]
    first, second = tk.items_of(t.metadata)

    def sub(context: str) -> str:  # a sub-agent answers its item's document at once
        item = next(it for it in (first, second) if it.question in context)
        return f"<docs>{item.targets[0]}</docs>\n"

    lines = [
        call("create_subagent", name="a", system_prompt="go")
        + call("create_subagent", name="b", system_prompt="go")
        + call("assign_task", agent="a", prompt="3")
        + call("assign_task", agent="a", prompt="2")
        + "\n",
        "<docs>a b 999</docs>\n",
    ]
    ep = await play(e, t, lines, sub)
    assert [ev.status for ev in ep.tool_log if ev.name == SWARM] == ["invalid_tool_call", "ok"]
    assert "no item 3" in next(ev.result + ev.error for ev in ep.tool_log if ev.status == "invalid_tool_call")
    # a names item 2's document; b was never assigned (stands for nothing); 999 stays an id
    assert ep.final_text.strip() == f"<docs>{second.targets[0]} 999</docs>"
    assert e.score(t, ep).components["perf"] == 0.5
    # `*` stands for every id any sub-agent returned
    ep = await play(e, t, [lines[0].replace('"3"', '"1"'), "<docs>*</docs>\n"], sub)
    assert set(ep.final_text.strip()[6:-7].split()) == {first.targets[0], second.targets[0]}
    assert e.score(t, ep).correct
    # without by_reference a number is words: the sub-agent is asked about "2"
    plain = env({"expert_grep": True}, item_counts=[2], max_critical_steps=10)
    asked: list[str] = []

    def record(context: str) -> str:
        asked.append(context)
        return "<docs>x</docs>\n"

    ep = await play(plain, t, [lines[0].replace('"3"', '"2"'), "<docs>a</docs>\n"], record)
    assert asked and all("answer: 2\n" in c for c in asked) and ep.final_text.strip() == "<docs>a</docs>"


async def test_train_budgets_let_the_serial_teacher_delegate_over_several_turns_and_held_out_keeps_the_plans() -> None:
    plan = {**demo_plan("swarm").env_options, "item_counts": [4], "expert_parallel_rate": 0.0}
    e = get_env("swarm", **plan)
    without = get_env("swarm", **{**plan, "train_budgets": []})
    train = e.generate("train", 40, seed=3)
    assert {t.metadata["budget"] for t in train} == {str(b) for b in set(plan["train_budgets"])}
    assert [t.metadata["items"] for t in train] == [t.metadata["items"] for t in without.generate("train", 40, seed=3)]
    assert all("budget" not in t.metadata for t in e.generate("heldout", 10, seed=3))
    # at budget 13 the serial teacher runs four turns, one sub-agent a turn, each named and numbered
    # in order, and answers citing every result: what a parallel turn recombines
    t = next(t for t in train if t.metadata["budget"] == "13")
    ep = await play(e, t, None)
    text = bytes(i for i in next(s for s in ep.samples if s.role == "policy").ids() if i < 256).decode()
    assert re.findall(r'"agent": "(\w)", "prompt": "(\d)"', text) == [("a", "1"), ("b", "2"), ("c", "3"), ("d", "4")]
    assert "[Steps: 12/13]" in text and text.rstrip().endswith("<docs>*</docs>")  # the plan's cite = "all"
    assert ep.counts["parallel_turns"] == 0 and e.score(t, ep).correct
    # the parallel teacher's one turn is those four pairs on one line
    par = get_env("swarm", **{**plan, "expert_parallel_rate": 1.0})
    ep = await play(par, t, None)
    text = bytes(i for i in next(s for s in ep.samples if s.role == "policy").ids() if i < 256).decode()
    (turn,) = [line for line in text.splitlines() if "assign_task" in line]
    assert re.findall(r'"name": "(\w+)", "args": \{"(?:name|agent)": "(\w)"', turn) == [
        (tool, name) for name in "abcd" for tool in ("create_subagent", "assign_task")
    ]
    assert ep.counts["parallel_turns"] == 1 and par.score(t, ep).correct


def test_the_brief_layout_lists_unpadded_briefs_and_needs_the_decade_last() -> None:
    plan = {**demo_plan("swarm").env_options, "item_counts": [2]}
    assert plan["layout"] == "brief"
    t = get_env("swarm", **plan).generate("heldout", 1, seed=0)[0]
    lines = t.prompt.splitlines()[1:]
    assert [it.question for it in tk.items_of(t.metadata)] == lines
    assert all(line == line.strip() and re.fullmatch(r"\w+: .+, \d+s", line) for line in lines)
    with pytest.raises(ValueError, match="layout 'brief' briefs questions that name the decade last"):
        get_env("swarm", **{**plan, "search": {**plan["search"], "fixed_offsets": False}})


def test_evaluations_hold_train_tasks_to_the_plans_budget_too() -> None:
    # train tasks draw budgets for the teacher and RL; the before/after rows compare train with held-out at one budget
    arm = swarm_eval.ArmModel(mode="swarm", env_options=demo_plan("swarm").env_options, model_dir=Path("/none"))
    env = swarm_eval._env(arm)
    assert env.options.train_budgets == [] and env.options.max_critical_steps == 4
    assert all("budget" not in t.metadata for t in env.generate("train", 20, seed=0))


def _single_options(n: int) -> dict[str, object]:
    """The demo's single arm at N items, every task at max_critical_steps."""
    return {**swarm_demo.arm_plan(demo_plan("swarm"), "single").env_options, "item_counts": [n], "train_budgets": []}


@pytest.mark.parametrize("n", [2, 4, 8])
async def test_the_single_agents_agenda_puts_each_item_where_a_sub_agent_reads_its_own(n: int) -> None:
    # The demo's single arm (by reference): after the prompt and after each turn the next item,
    # worded as a sub-agent's prompt, ends the context, so the agent's grep copies the decade from the
    # line it just read (as a sub-agent does) and never from the item list; `*` cites what it found.
    opts = _single_options(n)
    e = get_env("swarm", **{**opts, "max_critical_steps": n + 1})
    assert e.options.agenda and not get_env("swarm", **{**opts, "mode": "swarm"}).options.agenda
    t = e.generate("heldout", 1, seed=0)[0]
    items = tk.items_of(t.metadata)
    assert t.prompt.endswith(tk.HEADER + "".join(f"{it.question}\n" for it in items) + tk.agenda_line(items[0]))
    assert tk.agenda_line(items[0]) == f"Find the documents that answer: {items[0].question}\n"
    ep = await play(e, t, None)
    text = bytes(i for i in ep.samples[0].ids() if i < 256).decode()
    greps = re.findall(r'<tool>\{"name": "grep_corpus".*?</tool>\n', text)
    assert len(greps) == n and ep.counts["critical_steps"] == n + 1 and ep.counts["subagents"] == 0
    for it, line in zip(items, greps, strict=True):
        # each grep follows its own item's agenda line directly, and holds the decade's digits read there
        before = text[: text.index(line)]
        assert before.endswith(tk.agenda_line(it)) and it.question[-5:-2] in line
    assert text.rstrip().endswith("<docs>*</docs>") and e.score(t, ep).correct
    assert ep.final_text.strip() == "<docs>" + " ".join(it.targets[0] for it in items) + "</docs>"
    # the budget cuts a serial agent short: one step fewer and the last item goes unanswered
    short = get_env("swarm", **{**opts, "max_critical_steps": n})
    part = await play(short, t, None)
    assert short.score(t, part).components["perf"] == (n - 1) / n


async def test_star_in_a_single_answer_cites_only_what_the_agents_own_calls_returned() -> None:
    opts = _single_options(2)
    e = get_env("swarm", **opts)
    t = e.generate("heldout", 1, seed=0)[0]
    ep = await play(e, t, ["<docs>*</docs>\n"])  # no search first: `*` stands for nothing
    assert ep.final_text.strip() == "<docs>*</docs>" and e.score(t, ep).components["perf"] == 0.0
    # without by_reference the single agent has no agenda and `*` is a word like any other
    plain = get_env("swarm", **{**opts, "by_reference": False})
    assert not plain.options.agenda and not plain.generate("heldout", 1, seed=0)[0].prompt.endswith(
        tk.agenda_line(tk.items_of(t.metadata)[0])
    )
