"""`slipstream demo`: bring the whole local stack up, check it is healthy, and stop it.

For now the demo proves the stack works end to end (every service ready); the training body
(tiny model on the default task, live progress view) arrives with the next issue and slots in
between `wait_ready()` and `stop()`. Exit 0 only if every service became ready and then stopped
with exit code 0 (an orderly drain).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from slipstream.cli.spec import add_stack_arguments, spec_from_args


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="start the local stack, wait until every service is ready, print its health, stop",
        description="Start the local stack, wait for every service's /readyz, print the health table and stop.",
    )
    add_stack_arguments(p)
    p.add_argument(
        "--summary-json", type=Path, metavar="FILE", help="write {services: {name: {ready, pid}}, wall_time_s}"
    )
    p.set_defaults(func=run, parser=p)


def run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args, args.parser)

    import time

    from rich.console import Console

    from slipstream.cli.health_table import health_table
    from slipstream.cli.stack import Stack, StackError, StackInterrupted
    from slipstream.cli.stop_signals import StopSignals

    console = Console(highlight=False, soft_wrap=True)
    t0 = time.monotonic()
    stack = Stack(spec, log=lambda msg: console.print(f"[dim]·[/dim] {msg}"))
    error = ""
    console.print(f"slipstream demo: run [bold]{stack.spec.run_id}[/bold] in {stack.spec.run_dir}")
    with StopSignals(stack):
        try:
            stack.start()
            stack.wait_ready()
            stack.write_state()
            console.print(health_table(stack.health(), title="slipstream demo"))
            console.print(f"logs in {stack.spec.log_dir}/<name>.log")
        except StackInterrupted:
            error = "interrupted"
        except StackError as exc:
            error = str(exc)
            for name, tail in exc.tails.items():
                console.rule(f"last lines of {name}'s log")
                console.print(tail or "(empty)", markup=False)
        finally:
            codes = stack.stop()
    wall = time.monotonic() - t0
    services = {
        s.name: {"ready": s.ready_after_s is not None, "pid": s.pid, "exit_code": codes.get(s.name)}
        for s in stack.services.values()
    }
    ready = sum(1 for v in services.values() if v["ready"])
    bad_exits = {n: c for n, c in codes.items() if c != 0}
    if not error and bad_exits:
        error = "unclean stop: " + ", ".join(f"{n} exited with {c}" for n, c in bad_exits.items())
    ok = not error and ready == len(spec.services)
    if args.summary_json:
        args.summary_json.parent.mkdir(parents=True, exist_ok=True)
        summary = {
            "ok": ok,
            "error": error,
            "run_dir": str(stack.spec.run_dir),
            "services": services,
            "wall_time_s": round(wall, 3),
        }
        args.summary_json.write_text(json.dumps(summary, indent=2) + "\n")
    line = f"demo: {ready}/{len(spec.services)} services ready, stack stopped, {wall:.1f} s"
    console.print(f"[green]{line}[/green]" if ok else f"[red]{line}: {error or 'not every service was ready'}[/red]")
    return 0 if ok else 1
