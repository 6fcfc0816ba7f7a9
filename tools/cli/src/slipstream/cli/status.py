"""`slipstream status`: one look at a running stack, from its stack.json.

For the run in `--run-dir` (default `.slipstream/current`, the latest `slipstream up` or demo):
NATS and Redis reachability; each service's /readyz (state, and the policy version a worker
samples with); every stream of the subject table with its messages and each durable's backlog
(pending) and unacked deliveries (ack pending); dead letters per source stream (`dlq.<STREAM>`);
the latest announced and the promoted version (Redis's eval history, else the last
`weights.promoted`), the last eval result; the learner's last step with its staleness histogram.
`--json` prints the same as one JSON object. Exit 0 when the servers answer and every service is
ready, 1 otherwise, 2 when there is no stack.json to read.

The reading and the tables: `slipstream.stack.status`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from slipstream.stack.spec import HOME

DEFAULT_RUN_DIR = HOME / "current"


def register(sub: Any) -> None:
    p = sub.add_parser(
        "status",
        help="services and health, versions, backlog per stream, staleness, DLQ counts of a running stack",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_dir_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--timeout", type=float, default=3.0, metavar="S", help="connect budget for NATS/Redis (default 3)")
    p.set_defaults(func=run, parser=p)


def add_run_dir_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--run-dir",
        type=Path,
        default=DEFAULT_RUN_DIR,
        metavar="DIR",
        help=f"the run whose stack.json names the servers (default: {DEFAULT_RUN_DIR})",
    )


def run(args: argparse.Namespace) -> int:
    from slipstream.stack.status import StatusError, collect, exit_code, load_stack, render

    try:
        info = load_stack(args.run_dir)
    except StatusError as exc:
        print(f"slipstream status: {exc}")
        return 2
    import asyncio

    status = asyncio.run(collect(info, timeout_s=args.timeout))
    if args.json:
        print(json.dumps(status, indent=2, default=str))
    else:
        from rich.console import Console

        console = Console(highlight=False, soft_wrap=True)
        for part in render(status):
            console.print(part)
    return exit_code(status)
