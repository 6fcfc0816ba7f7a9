"""`slipstream bench <name> ...`: every argument after `bench` goes to the bench package's own parser.

The benches (one module each) live in tools/bench (`slipstream.bench`); `slipstream bench --help`
lists them. Nothing of theirs is imported until `slipstream bench` runs, so `slipstream --help`
stays instant.
"""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks that print figures and write JSON (bench --help lists them)",
        add_help=False,
        description="Run a benchmark.",
    )
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=run, takes_extras=True)


def run(args: argparse.Namespace) -> int:
    from slipstream.bench.main import main

    return main(args.rest)
