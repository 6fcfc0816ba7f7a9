"""`slipstream serve-engine [--server.port N] [--model.preset tiny] ...`: Slipstream's inference server.

The same process as `python -m slipstream.serve.inference`: a TorchEngine over `[model]` behind
the token-id HTTP API that rollout workers drive with `[engine] type = "http"`. Every flag after
the command goes to the server's own parser (`slipstream serve-engine --help` lists them).
"""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser(
        "serve-engine",
        help="run an inference server that rollout workers drive over HTTP ([engine] type = 'http')",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,  # --help goes to the server's parser, which knows the config flags
    )
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=run, takes_extras=True)


def run(args: argparse.Namespace) -> int:
    from slipstream.serve.inference import main

    return main(args.rest)
