"""The `slipstream` command: one sub-command per module (up.py, demo.py, bench.py, ...).

Each command module exposes `register(subparsers)` (adds its parser, sets `func`) and imports
its heavy dependencies only inside `run`, so `slipstream --help` answers at once.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Order shown in --help (promotion registers eval, promote and rollback).
COMMANDS: tuple[str, ...] = (
    "up",
    "demo",
    "train",
    "bench",
    "status",
    "top",
    "report",
    "promotion",
    "chaos",
    "serve",
    "serve-engine",
    "mtp-distill",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slipstream",
        description="Slipstream: asynchronous RL for agentic LLMs as services over NATS JetStream.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"slipstream.cli.{name.replace('-', '_')}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # parse_known_args so that `bench` can hand its own flags (even --help) to its own parser.
    args, extras = parser.parse_known_args(argv)
    if extras:
        if not getattr(args, "takes_extras", False):
            getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(extras)}")
        args.rest = [*extras, *args.rest]
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
