"""What a recall_kept run's summaries held, read from episodes: version 0 beside a stored version.

Plays the plan's held-out tasks (the bench's, seed + 7) at the rollout temperature, `samples` each,
and sorts every episode by what its summaries held when the question came: no summary; a summary
with no fact; the asked fact under its own key; the asked value under another key; only other facts.
Beside each: the episodes answered right, and the facts a summary held (is RL keeping *one* fact,
the asked one, or learning to keep everything?); and, apart from timing, among summaries holding a fact
that opened after the asked fact had arrived, the share that kept it beside what a random arrived fact gives;
and the share of fact-holding summaries whose every key=value is one of the task's facts (exact copies).

    python examples/runs/recall_kept/read_summaries.py examples/recall_kept.toml RUN/seed0 policy 40 [tasks] [samples]
"""

import asyncio
import json
import sys
from collections import Counter
from pathlib import Path

from slipstream.engine import SamplingParams
from slipstream.envs.recall import _SUMMARY as SUMMARY  # what a summary wrote, as kept_asked reads it
from slipstream.envs.recall import _turns
from slipstream.harness.evaluate import greedy_params
from slipstream.harness.rollout import rollout_episodes
from slipstream.run.heldout import HeldOut
from slipstream.run.runfile import load
from slipstream.store import setup_store
from slipstream.store.config import StoreConfig
from slipstream.weights import fetch_version, manifest_key


def pairs(written: list[str]) -> list[tuple[str, str]]:
    """Every key=value the summaries wrote."""
    return [(k, v) for s in written for k, _, v in (f.partition("=") for f in s.split() if "=" in f)]


def kind(written: list[str], asked: str, value: str) -> str:
    facts = pairs(written)
    if not written:
        return "no summary"
    if not facts:
        return "no fact"
    if (asked, value) in facts:
        return "asked fact"
    if any(v == value for _, v in facts):
        return "asked value, other key"
    return "other facts"


FACT_KINDS = ("asked fact", "asked value, other key", "other facts")


async def play(ev: HeldOut, samples: int) -> dict:
    g = greedy_params(ev.env)
    params = SamplingParams(temperature=ev.temperature, max_tokens=g.max_tokens, stop=g.stop)
    rows: Counter = Counter()
    right: Counter = Counter()
    held: Counter = Counter()
    content: Counter = Counter()
    for i, spec in enumerate(ev.tasks):
        script = ev.env.script(spec)
        task_facts = {tuple(f) for f in script.facts}
        asked_at = script.at[[f[0] for f in script.facts].index(script.question)]
        episodes = await rollout_episodes(
            ev.engine, ev.tokenizer, ev.env, spec, group_size=samples, params=params, worker_id="read",
            group_id=f"read/{i}", summary=ev.summary, purpose="eval",
        )  # fmt: skip
        for e in episodes:
            texts = ["".join(t.text for t in s.turns if t.role == "policy") for s in e.samples]
            written = [m for text in texts for m in SUMMARY.findall(text)]
            k = kind(written, script.question, script.answer)
            rows[k] += 1
            right[k] += ev.env.score(spec, e).correct
            if written:
                held[len([f for f in written[-1].split() if "=" in f])] += 1
            if k in FACT_KINDS:
                content["fact summaries"] += 1  # every key=value written is one of the task's facts, exactly
                content["exact copies"] += all(pair in task_facts for pair in pairs(written))
                last = max(_turns(e.counts, "summary_at_turn_"), default=-1)
                if asked_at <= last:  # content apart from timing: the asked fact had arrived
                    content["asked arrived"] += 1
                    content["kept asked"] += k == "asked fact"
                    content["chance"] += 1 / len([t for t in script.at if t <= last])
    n = sum(rows.values())
    return {
        "episodes": n,
        "success": round(sum(right.values()) / n, 4),
        "by_summary": {k: {"share": round(v / n, 4), "answered_right": right[k]} for k, v in rows.most_common()},
        "facts_in_last_summary": dict(sorted(held.items())),
        "exact_copies": round(content["exact copies"] / max(content["fact summaries"], 1), 4),
        # Of the summaries holding a fact whose last one opened after the asked fact arrived: the share
        # that kept the asked one, and what keeping one arrived fact at random would give.
        "asked_arrived": content["asked arrived"],
        "kept_asked_when_arrived": round(content["kept asked"] / max(content["asked arrived"], 1), 4),
        "random_fact_would_keep": round(content["chance"] / max(content["asked arrived"], 1), 4),
    }


async def main(plan_path: str, seed_dir: str, run_id: str, version: int, tasks: int, samples: int) -> None:
    plan = load(plan_path).plan()
    plan.seed = int(Path(seed_dir).name.removeprefix("seed"))
    plan.heldout_tasks, plan.train_eval_tasks = tasks, 0
    ev = HeldOut(plan, Path(seed_dir) / "model-init")
    await ev.start()
    try:
        out = {"v0": await play(ev, samples)}
        store = setup_store(StoreConfig(type="local", root=str(Path(seed_dir) / run_id / "data" / "store")))
        manifest, tensors = await asyncio.to_thread(fetch_version, store, manifest_key(run_id, version))
        ev.engine.apply_weights(manifest.policy_version, tensors)
        out[f"v{version}"] = await play(ev, samples)
    finally:
        await ev.stop()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    a = sys.argv[1:]
    asyncio.run(main(a[0], a[1], a[2], int(a[3]), int(a[4]) if len(a) > 4 else 64, int(a[5]) if len(a) > 5 else 4))
