"""`slipstream bench async`: the same short training, synchronous (max_staleness=0) vs asynchronous.

Both runs use the full local stack (nats-server, Redis and the five pipeline services as
separate processes) with the same model, warm-start, task stream, seeds and step count; only
`max_staleness` differs. With max_staleness=0 the task source releases one step's worth of tasks
at a time, stamped with the current version, so generation and training alternate (the
synchronous baseline of the same code); with max_staleness=2 rollouts run ahead while the learner
trains. Printed: wall time from the stack being ready to the learner's last step, the ratio
(sync / async), held-out accuracy before and after each run. Target: async >= 1.5x faster with no
loss of final accuracy.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "async",
        help="synchronous (max_staleness=0) vs asynchronous (max_staleness=2) training wall time",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", metavar="FILE", default="", help="write the results as JSON to FILE")
    p.add_argument("--steps", type=int, default=30, help="learner steps per run (default 30)")
    p.add_argument("--staleness", type=int, default=2, help="max_staleness of the asynchronous run (default 2)")
    p.add_argument(
        "--run-dir", type=Path, default=None, help="where both runs go (default .slipstream/bench/async-<ts>)"
    )
    p.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    result = run(args)
    return 0 if result["ok"] else 1


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    from slipstream.run.presets import demo_plan
    from slipstream.run.training import run_training

    console = Console(highlight=False)
    root = args.run_dir or Path(".slipstream/bench") / time.strftime("async-%Y%m%d-%H%M%S")
    runs: dict[str, Any] = {}
    for label, staleness in (("sync", 0), ("async", args.staleness)):
        plan = demo_plan()
        plan.max_steps = args.steps
        plan.max_staleness = staleness
        plan.eval_every = 0
        console.print(f"[bold]{label}[/bold]: {plan.max_steps} steps, max_staleness={staleness} ...")
        summary = run_training(plan, root / label)
        if not summary.ok:
            console.print(f"[red]{label} run failed:[/red] {summary.error}")
        runs[label] = {
            "ok": summary.ok,
            "error": summary.error,
            "max_staleness": staleness,
            "steps": summary.steps,
            "train_time_s": summary.train_time_s,
            "wall_time_s": summary.wall_time_s,
            "heldout_accuracy_before": summary.heldout_accuracy_before,
            "heldout_accuracy_after": summary.heldout_accuracy_after,
            "trajectories": summary.trajectories,
            "run_dir": summary.run_dir,
        }
    ok = all(r["ok"] for r in runs.values())
    sync, asyn = runs["sync"], runs["async"]
    ratio = sync["train_time_s"] / asyn["train_time_s"] if ok and asyn["train_time_s"] else 0.0
    acc_delta = asyn["heldout_accuracy_after"] - sync["heldout_accuracy_after"]
    result = {
        "ok": ok,
        "runs": runs,
        "speedup": ratio,
        "final_accuracy_async_minus_sync": acc_delta,
        "targets": {"speedup_min": 1.5, "speedup_met": ratio >= 1.5},
    }
    table = Table(title="slipstream bench async")
    for col in ("run", "max_staleness", "steps", "time to last step", "held-out before", "held-out after"):
        table.add_column(col, justify="right")
    for label, r in runs.items():
        table.add_row(
            label,
            str(r["max_staleness"]),
            str(r["steps"]),
            f"{r['train_time_s']:.1f} s",
            f"{r['heldout_accuracy_before']:.3f}",
            f"{r['heldout_accuracy_after']:.3f}",
        )
    console.print(table)
    console.print(
        f"speedup (sync / async time to the same step): [bold]{ratio:.2f}x[/bold] (target >= 1.5x); "
        f"final held-out accuracy async - sync: {acc_delta:+.3f}"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result
