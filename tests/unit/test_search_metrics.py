"""The search metrics (item 7) and Context-1's SFT filter (item 6), on hand-built cases.

Episodes are played through the real harness with the deterministic test backend (see
test_search_env.py, whose helpers these are)."""

from __future__ import annotations

import asyncio

import pytest
from test_search_env import env, play, search, task

from slipstream.envs.search.curation import SftCandidate, SftFilterConfig, candidate_of, sft_filter
from slipstream.envs.search.expert import call
from slipstream.envs.search.metrics import aggregate, episode_metrics

pytestmark = pytest.mark.unit


async def test_episode_metrics_by_hand() -> None:
    e = env()
    t = task(e, hops=2)
    first, second = t.metadata["targets"].split()
    # Read both targets (a turn with two parallel calls), search once, prune two chunks of the
    # search (irrelevant ones) and one of the second target, refuse nothing, output [first, x].
    probe = await play(e, t, [search("grey heron town"), "<docs>x</docs>\n"])
    junk = [c for c in probe.tool_log[0].info["chunks"].split(",") if c.split("#")[0] not in (first, second)][:2]
    reads = call("read_document", doc_id=first) + call("read_document", doc_id=second) + "\n"
    probe2 = await play(e, t, [search("grey heron town"), reads, "<docs>x</docs>\n"])
    second_chunk = next(c for c in probe2.tool_log[2].info["chunks"].split(","))
    lines = [
        search("grey heron town"),
        reads,
        call("prune_chunks", chunk_ids=[*junk, second_chunk]) + "\n",
        f"<docs>{first} w9999</docs>\n",
    ]
    ep = await play(e, t, lines)
    m = episode_metrics(t.metadata, ep)
    assert m.parse_ok and not m.final_answer_found  # the answer is in the second target
    assert (m.precision, m.output_recall, m.f1) == (0.5, 0.5, 0.5)
    assert m.traj_recall == 1.0  # the pruned second target still counts
    assert (m.pruned, m.pruned_irrelevant) == (3, 2)
    assert (m.tool_calls, m.call_turns, m.turns) == (4, 3, 4)
    assert m.budget_refusals == 0
    c = candidate_of(t.metadata, ep, reward=1.5)
    assert (c.query, c.traj_recall, c.output_recall, c.parse_ok, c.reward) == (t.metadata["key"], 1.0, 0.5, True, 1.5)
    agg = aggregate([m, m], prefix="eval/search")
    assert agg["eval/search/prune_accuracy"] == pytest.approx(2 / 3)
    assert agg["eval/search/tool_calls_per_turn"] == pytest.approx(4 / 3)
    assert agg["eval/search/turns_per_episode"] == 4.0 and agg["eval/search/final_answer_found"] == 0.0


async def test_budget_refusals_and_malformed_output_are_counted() -> None:
    e = env(budget_tokens=1024, search_tokens=1024, reserve_tokens=200, hard_cutoff=1.0)
    t = task(e)
    ep = await play(e, t, [search("town company patent thread it is a"), search("the of"), "no list\n"])
    m = episode_metrics(t.metadata, ep)
    assert m.budget_refusals == 1 and not m.parse_ok and m.output_recall == 0.0
    agg = aggregate([m, episode_metrics(t.metadata, await play(e, t, ["no list\n"]))])
    assert agg["search/budget_refusals"] == 1.0 and agg["search/budget_refusals_per_episode"] == 0.5
    agg = aggregate([m])
    assert agg["search/malformed_output"] == 1.0 and "search/prune_accuracy" not in agg
    assert aggregate([]) == {}


def _c(i: int, query: str, traj: float, out: float, *, ok: bool = True, reward: float = 0.0) -> SftCandidate:
    return SftCandidate(
        episode_id=f"e{i}", query=query, traj_recall=traj, output_recall=out, parse_ok=ok, reward=reward
    )


def test_sft_filter_rules() -> None:
    full = [_c(i, f"q{i}", 0.6, 0.5) for i in range(40)]  # kept in full
    cands = [
        *full,
        _c(100, "h", 1.0, 1.0, reward=1.0),  # high recall, one query: only the best one stays
        _c(101, "h", 1.0, 0.9, reward=2.0),
        _c(102, "h", 1.0, 1.0, reward=0.5),
        _c(103, "m", 0.6, 0.5, ok=False),  # malformed
        _c(104, "g", 1.0, 0.2),  # traj >> output: dropped entirely
        _c(105, "z1", 0.0, 0.0),  # zero-recall negatives, one per query, cap 5 % of 41 positives -> 2
        _c(106, "z1", 0.0, 0.0),
        _c(107, "z2", 0.3, 0.0),
        _c(108, "z3", 0.0, 0.0),
    ]
    sel = sft_filter(cands)
    kept = set(sel.kept)
    assert {f"e{i}" for i in range(40)} <= kept
    assert "e101" in kept and not {"e100", "e102"} & kept
    assert "e103" not in kept and "e104" not in kept
    assert {"e105", "e107"} <= kept and not {"e106", "e108"} & kept
    assert sel.counts == {
        "dropped_duplicate_high": 2,
        "dropped_gap": 1,
        "dropped_malformed": 1,
        "dropped_negative_cap": 1,
        "dropped_negative_duplicate": 1,
        "kept_full": 40,
        "kept_high": 1,
        "kept_negative": 2,
    }


def test_lower_recall_is_kept_at_a_diminishing_rate() -> None:
    def share(out: float) -> float:
        cands = [_c(i, f"q{i}", 0.4, out) for i in range(2000)]
        return len(sft_filter(cands, SftFilterConfig(seed=1)).kept) / 2000

    rates = [share(x) for x in (0.1, 0.2, 0.3)]
    # (out / 0.4)^2: 1/16, 1/4, 9/16.
    assert rates == pytest.approx([1 / 16, 1 / 4, 9 / 16], abs=0.03)
    assert sft_filter([_c(1, "q", 0.4, 0.2)]).kept == sft_filter([_c(1, "q", 0.4, 0.2)]).kept


async def test_an_imperfect_expert_and_the_filter_over_its_episodes() -> None:
    """With slips, the expert misses the answer on some tasks and adds distractors on others;
    the SFT filter keeps the good episodes, drops or thins the rest."""
    e = env(expert_stop_rate=0.4, expert_distractor_rate=0.4)
    tasks = e.generate("train", 40, seed=5)
    unique = list({t.metadata["key"]: t for t in tasks}.values())
    metrics, cands = [], []
    for t in unique:
        ep = await play(e, t)
        metrics.append(episode_metrics(t.metadata, ep))
        cands.append(candidate_of(t.metadata, ep))
    agg = aggregate(metrics)
    assert 0.3 < agg["search/final_answer_found"] < 0.9 and agg["search/precision"] < 1.0
    assert all(m.parse_ok for m in metrics)
    sel = sft_filter(cands)
    kept = set(sel.kept)
    perfect = {c.episode_id for c in cands if c.output_recall == 1.0}
    assert perfect <= kept and len(kept) < len(cands)
    assert all(c.episode_id not in kept for c in cands if c.output_recall == 0.0 and c.traj_recall > 0.5)


def test_the_warm_start_trains_only_on_the_episodes_the_filter_keeps() -> None:
    from slipstream.engine import ByteTokenizer
    from slipstream.supervised.warmstart import expert_episodes, expert_examples

    e = env(expert_stop_rate=0.5, expert_distractor_rate=0.3)
    tasks = list({t.metadata["key"]: t for t in e.generate("train", 60, seed=2)}.values())
    played = asyncio.run(expert_episodes(e, ByteTokenizer(), tasks))
    keep = e.curate_expert_episodes(tasks, played)
    kept_tasks = [t for t, k in zip(tasks, keep, strict=True) if k]
    assert 0 < len(kept_tasks) < len(tasks)
    # Every episode the filter dropped is one the rules drop: not a high-recall one, by construction.
    cands = [candidate_of(t.metadata, p) for t, p in zip(tasks, played, strict=True)]
    assert all(k or c.output_recall < 0.8 for c, k in zip(cands, keep, strict=True))
    examples = expert_examples(e, ByteTokenizer(), tasks)
    assert len(examples) == sum(
        len([s for s in p.samples if s.trainable]) for p, k in zip(played, keep, strict=True) if k
    )
