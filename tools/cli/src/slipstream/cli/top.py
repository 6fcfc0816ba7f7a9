"""`slipstream top`: a live terminal view of a running stack.

Reads the run's `stack.json` (written by `slipstream up` / `demo`), then, every interval: probes
each service's /readyz and scrapes its /metrics; asks the bus for every work stream's backlog
and the dead-letter count; follows `learner.step` (the run's history), `weights.announce` and
`weights.promoted` (the latest of each). It shows each service with its replica, health and
throughput, the backlog of every stage with the slowest one highlighted (the stage whose
backlog would take longest to drain at its consumer's current rate), the learner, announced,
promoted and applied versions, reward and accuracy sparklines and staleness.

`--once` samples twice, one interval apart (rates need two scrapes), prints one frame to
stdout and exits: for tests, scripts and terminals that are not one.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from slipstream.stack.spec import HOME


def register(sub: Any) -> None:
    p = sub.add_parser(
        "top",
        help="live view of a running stack: services, backlogs, versions, reward",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--run-dir", type=Path, default=HOME / "current", metavar="DIR", help="the run (default .slipstream/current)"
    )
    p.add_argument("--once", action="store_true", help="print one frame and exit (no terminal needed)")
    p.add_argument("--interval", type=float, default=2.0, metavar="S", help="seconds between samples (default 2)")
    p.add_argument("--width", type=int, default=None, help="columns to render (default: the terminal's, or 120)")
    p.set_defaults(func=run, parser=p)


def run(args: argparse.Namespace) -> int:
    from slipstream.run.top import StackStateError, show

    if args.interval <= 0:
        args.parser.error(f"--interval must be > 0, not {args.interval}")
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False, width=args.width)
    if args.width is None and not console.is_terminal:
        console = Console(highlight=False, width=120)
    try:
        return asyncio.run(show(args.run_dir, console, once=args.once, interval=args.interval))
    except KeyboardInterrupt:
        return 0
    except StackStateError as exc:
        console.print(f"[red]slipstream top: {escape(str(exc))}[/red]")
        return 1
