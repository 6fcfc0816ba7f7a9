"""`slipstream bench search-budget`: does the search plan's budget need pruning? Two teachers, measured.

The demo plan's `search` options (examples/search.toml's `[env] options`, or `--options` JSON over them) give 2-3
hop tasks whose first-hop search returns distractors that share the clues, and whose later hops
return documents naming the bridge entity; a useful episode reads more than the token budget
holds. This plays the scripted expert through the real episode harness (byte tokenizer, the
plan's backend) as three teachers on the same `--tasks` distinct train and held-out tasks:

- `never_prunes` (expert_prune_rate 0): the budget fills, its calls are refused at the hard
  cutoff or find no room (`NO_ROOM`), and it concludes with what it saw;
- `prunes` (expert_prune_rate 1): prunes the non-target chunks past half the budget and finishes;
- `warm_start`: the plan's own rate (<= 0.1), the teacher whose episodes warm-start the model.

Per teacher and split: final-answer-found (also by hop count), output and trajectory recall, F1,
prune accuracy, the share of episodes that prune, turns per episode (mean and median), tool
calls per turn, budget refusals, the share of episodes refused at the hard cutoff, the share
blocked by the budget (refused or no room) and that share among the failed episodes. `checks`
says whether the plan meets issue 33's sizing (never_prunes fails >= half the tasks, prunes
succeeds on >= 0.9, turns median > 2, prune accuracy defined) on both splits and whether what the
warm-start trains on (the teacher over every train task, after the SFT filter: `warm_start_kept`) prunes
in at most a tenth of its episodes, and `heldout` what
separates the held-out split from training: its documents (none shared), its entities (none
shared) and the question words no training question uses (its domain's own nouns).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from typing import Any

from slipstream.bench.main import write_json

SPLITS = ("train", "heldout")
_WORD = re.compile(r"[a-z]+")


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "search-budget",
        help="the search plan's budget: a teacher that never prunes vs one that prunes (train and held-out)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", metavar="FILE", default="", help="write the results as JSON to FILE")
    p.add_argument("--tasks", type=int, default=200, help="tasks per split (default 200)")
    p.add_argument("--seed", type=int, default=0, help="task draw seed (default 0)")
    p.add_argument("--options", default="{}", help="JSON object of search options over the demo plan's")
    p.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    from slipstream.run.presets import demo_plan

    overrides = json.loads(args.options)
    if not isinstance(overrides, dict):
        raise SystemExit(f"--options must be a JSON object, got {args.options!r}")
    result = measure({**demo_plan("search").env_options, **overrides}, tasks=args.tasks, seed=args.seed)
    for teacher, splits in result["teachers"].items():
        for split, m in splits.items():
            print(
                f"{teacher:>12} {split:>7}: final answer found {m['final_answer_found']:.3f} "
                f"(by hops {m['final_answer_by_hops']}), prune share {m['prune_share']:.3f}, "
                f"prune accuracy {m.get('prune_accuracy', float('nan')):.3f}, turns median {m['turns_median']}, "
                f"refused at the cutoff {m['refused_share']:.3f}, failures blocked by the budget "
                f"{m['failed_blocked_share']}"
            )
    kept = result["warm_start_kept"]
    print(
        f"warm-start data: the teacher prunes in {kept['teacher_prune_share']:.3f} of {kept['episodes']} train "
        f"episodes, {kept['kept_prune_share']:.3f} of the {kept['kept']} the SFT filter keeps"
    )
    print(f"checks: {result['checks']}")
    write_json(result, args.json)
    return 0 if all(result["checks"].values()) else 1


def measure(options: dict[str, Any], *, tasks: int, seed: int = 0) -> dict[str, Any]:
    """The three teachers' metrics on `tasks` distinct train and `tasks` distinct held-out tasks."""
    from slipstream.engine import ByteTokenizer
    from slipstream.envs import get_env
    from slipstream.supervised.expert import expert_episodes

    if tasks < 1:
        raise ValueError(f"tasks must be >= 1, got {tasks}")
    tok = ByteTokenizer()
    teachers = {
        "never_prunes": 0.0,
        "prunes": 1.0,
        "warm_start": float(options.get("expert_prune_rate", 1.0)),
    }
    out: dict[str, dict[str, dict[str, Any]]] = {}
    env = get_env("search", **options)
    specs = {split: _distinct_tasks(env, split, tasks, seed) for split in SPLITS}
    for teacher, rate in teachers.items():
        env = get_env("search", **{**options, "expert_prune_rate": rate})
        out[teacher] = {}
        for split in SPLITS:
            episodes = asyncio.run(expert_episodes(env, tok, specs[split]))
            out[teacher][split] = _metrics(env, specs[split], episodes)
    kept = warm_start_kept(options)
    checks = {
        f"{split}_{name}": ok
        for split in SPLITS
        for name, ok in (
            ("never_prunes_fails_half", out["never_prunes"][split]["final_answer_found"] <= 0.5),
            ("prunes_succeeds", out["prunes"][split]["final_answer_found"] >= 0.9),
            ("turns_median_over_2", out["prunes"][split]["turns_median"] > 2),
            ("prune_accuracy_defined", "prune_accuracy" in out["prunes"][split]),
            ("warm_start_prunes_at_most_0.1", out["warm_start"][split]["prune_share"] <= 0.1),
        )
    }
    checks["warm_start_kept_prunes_at_most_0.1"] = kept["kept_prune_share"] <= 0.1
    return {
        "bench": "search-budget",
        "options": options,
        "tasks_per_split": tasks,
        "seed": seed,
        "teachers": out,
        "warm_start_kept": kept,
        "checks": checks,
        "heldout": _heldout_difference(env, specs),
    }


def warm_start_kept(options: dict[str, Any]) -> dict[str, Any]:
    """What the warm-start trains on: the plan's teacher over every train task, then the env's SFT filter.

    The filter keeps the episodes that found their targets, and under this budget those are mostly the
    ones that pruned, so the kept episodes prune far more often than the teacher does; the share among
    them (`kept_prune_share`) is what the model copies, and what issue 33's <= 0.1 applies to."""
    from slipstream.engine import ByteTokenizer
    from slipstream.envs import get_env
    from slipstream.envs.search.metrics import episode_metrics
    from slipstream.supervised.expert import expert_episodes

    env: Any = get_env("search", **options)
    pool = [t for t in env.corpus.tasks if env.split_of(t.key) == "train"]
    specs = [env.task_spec(t, split="train", seed=0, index=i) for i, t in enumerate(pool)]
    episodes = asyncio.run(expert_episodes(env, ByteTokenizer(), specs))
    keep = env.curate_expert_episodes(specs, episodes)
    pruned = [episode_metrics(s.metadata, e).pruned > 0 for s, e in zip(specs, episodes, strict=True)]
    kept = [p for p, k in zip(pruned, keep, strict=True) if k]
    return {
        "episodes": len(episodes),
        "teacher_prune_share": sum(pruned) / len(pruned),
        "kept": len(kept),
        "kept_prune_share": sum(kept) / len(kept) if kept else 0.0,
    }


def _distinct_tasks(env: Any, split: str, n: int, seed: int) -> list[Any]:
    """`n` distinct tasks of `split`, drawn without replacement (ValueError if the corpus has fewer)."""
    import random

    pool = [t for t in env.corpus.tasks if env.split_of(t.key) == split]
    if len(pool) < n:
        raise ValueError(f"the corpus has {len(pool)} {split} tasks, fewer than the {n} asked for")
    drawn = random.Random(f"search-budget|{split}|{seed}").sample(pool, n)
    return [env.task_spec(t, split=split, seed=seed, index=i) for i, t in enumerate(drawn)]


def _metrics(env: Any, specs: list[Any], episodes: list[Any]) -> dict[str, Any]:
    metrics: dict[str, Any] = env.eval_metrics(specs, episodes)
    by_hops: dict[str, list[bool]] = {}
    correct = [env.score(spec, episode).correct for spec, episode in zip(specs, episodes, strict=True)]
    for spec, ok in zip(specs, correct, strict=True):
        by_hops.setdefault(spec.metadata["hops"], []).append(ok)
    metrics.update(
        {
            "final_answer_by_hops": {h: round(sum(v) / len(v), 3) for h, v in sorted(by_hops.items())},
            "hops": {h: len(v) for h, v in sorted(by_hops.items())},
            "refused_share": sum(any(ev.info.get("refused") for ev in e.tool_log) for e in episodes) / len(episodes),
            "budget_blocked_share": sum(map(_blocked, episodes)) / len(episodes),
            "failed_blocked_share": _share([_blocked(e) for e, ok in zip(episodes, correct, strict=True) if not ok]),
        }
    )
    return metrics


def _blocked(episode: Any) -> bool:
    """Whether a call of the episode met the budget: refused (hard cutoff, no room) or given no chunks
    because none fit what the budget left (turn.py's NO_ROOM)."""
    from slipstream.envs.search.turn import NO_ROOM

    return any(ev.info.get("refused") or ev.result == NO_ROOM for ev in episode.tool_log)


def _share(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def _heldout_difference(env: Any, specs: dict[str, list[Any]]) -> dict[str, Any]:
    """What the held-out split shares with training: documents, entities, question words."""
    corpus = env.corpus
    by_key = {t.key: t for t in corpus.tasks}

    def docs(split: str) -> set[str]:
        return {d for t in corpus.tasks if env.split_of(t.key) == split for d in (*t.targets, *t.distractors)}

    def names(split: str) -> set[str]:
        titles = {d.doc_id: d.title for d in corpus.documents}
        return {titles[d] for d in docs(split)}

    def words(split: str) -> set[str]:
        return {w for s in specs[split] for w in _WORD.findall(by_key[s.metadata["key"]].question.lower())}

    train_words = {w for t in corpus.tasks if env.split_of(t.key) == "train" for w in _WORD.findall(t.question.lower())}
    return {
        "domain": env.options.heldout_domain,
        "distinct_tasks": {split: len({s.metadata["key"] for s in specs[split]}) for split in SPLITS},
        "shared_documents": len(docs("train") & docs("heldout")),
        "shared_entities": len(names("train") & names("heldout")),
        "question_words_unseen_in_training": sorted(words("heldout") - train_words),
    }
