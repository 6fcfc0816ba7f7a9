"""`slipstream bench code-baselines`: trivial policies on the code demo's tasks, graded by the env's grader.

The baselines (slipstream.envs.code.baselines): the unmodified file, the docstring-word rule that
solved every old `bugfix` task, and a random one-token edit. Each writes a patch for every task of
the demo's held-out set (and its train-eval set), the same tasks `slipstream demo --env code
--seed S` evaluates (`generate(split, n, S + 7)`), and `Code.grade` scores it in a fresh sandbox.
Printed per baseline and split: pass rate (all tests pass) and mean reward; `--json FILE` writes
the figures and the per-template pass rates. `--source bugfix` scores the old generator's tasks.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "code-baselines",
        help="trivial policies (unmodified, docstring rule, random edit) on the code demo's held-out tasks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seed", type=int, default=0, help="the demo seed whose task sets are scored (default 0)")
    p.add_argument("--heldout-tasks", type=int, default=96, help="held-out tasks (default 96, the demo's)")
    p.add_argument("--train-tasks", type=int, default=64, help="train-eval tasks (default 64, the demo's; 0: none)")
    p.add_argument("--source", choices=("programs", "bugfix"), default=None, help="task source (default the demo's)")
    p.add_argument("--random-seeds", type=int, default=2, help="random edits per task (default 2)")
    p.add_argument("--json", metavar="FILE", default="", help="write the results as JSON to FILE")
    p.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    result = run(
        seed=args.seed,
        heldout_tasks=args.heldout_tasks,
        train_tasks=args.train_tasks,
        source=args.source,
        random_seeds=args.random_seeds,
    )
    for row in result["rows"]:
        print(
            f"{row['baseline']:<15} {row['split']:<8} pass rate {row['pass_rate']:.3f} "
            f"({row['passed']}/{row['graded']})  mean reward {row['mean_reward']:.3f}"
        )
    print(f"{result['wall_s']:.0f} s, source {result['source']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def run(
    *, seed: int, heldout_tasks: int, train_tasks: int, source: str | None = None, random_seeds: int = 2
) -> dict[str, Any]:
    """Every baseline's pass rate on the demo's task sets for `seed`, graded by `Code.grade`."""
    from slipstream.envs import get_env
    from slipstream.envs.base import Split
    from slipstream.envs.code import Code
    from slipstream.envs.code.baselines import BASELINES, patch_of
    from slipstream.run.presets import demo_plan

    options = {**demo_plan("code").env_options, **({"source": source} if source else {})}
    env = get_env("code", **options)
    assert isinstance(env, Code)
    start = time.monotonic()
    rows: list[dict[str, Any]] = []
    splits: tuple[tuple[Split, int], ...] = (("heldout", heldout_tasks), ("train", train_tasks))
    for split, n in splits:
        tasks = env.generate(split, n, seed + 7) if n else []
        for baseline in BASELINES:
            draws = range(random_seeds) if baseline == "random_edit" else range(1)
            passed, graded, reward = 0, 0, 0.0
            by_template: dict[str, list[int]] = defaultdict(lambda: [0, 0])
            for task in tasks:
                code = env.code_task(task)
                for draw in draws:
                    score = env.grade(task, json.dumps(patch_of(baseline, code, draw)))
                    passed += int(score.correct)
                    graded += 1
                    reward += score.reward
                    template = code.meta.get("template", "bugfix")
                    by_template[template][0] += int(score.correct)
                    by_template[template][1] += 1
            rows.append(
                {
                    "baseline": baseline,
                    "split": split,
                    "passed": passed,
                    "graded": graded,
                    "pass_rate": round(passed / graded, 4) if graded else 0.0,
                    "mean_reward": round(reward / graded, 4) if graded else 0.0,
                    "by_template": {t: round(p / g, 3) for t, (p, g) in sorted(by_template.items())},
                }
            )
    return {"source": options["source"], "seed": seed, "rows": rows, "wall_s": round(time.monotonic() - start, 1)}
