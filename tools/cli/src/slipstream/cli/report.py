"""`slipstream report RUN --out DIR`: after a run, an HTML page and PNG plots, readable offline.

From the run directory it reads `summary.json` (what `slipstream demo` writes; without it, the
learner's `step` log lines), the services' JSON logs under `logs/`, and the span files when the
stack ran with `--traces` (named in `stack.json`). It plots reward and accuracy per step (with
held-out accuracy where it was measured), the staleness distribution, throughput per service
over time, time-to-policy per version, where time went per stage, and per step the
train–inference mismatch, the share of tokens the off-policy mask removed and the KL to the
reference (when the learner reported them). A plot whose data is
missing is skipped with a note saying why. `DIR/report.json` holds every plotted series, so a
script or a test can check what was drawn.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from slipstream.stack.spec import HOME


def register(sub: Any) -> None:
    p = sub.add_parser(
        "report",
        help="write an HTML page and PNG plots of a finished run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "run", nargs="?", default=str(HOME / "current"), help="run directory, or a run id under .slipstream/runs"
    )
    p.add_argument("--out", type=Path, default=None, metavar="DIR", help="where to write (default RUN/report)")
    p.add_argument(
        "--traces", type=Path, action="append", default=[], metavar="FILE", help="span files (default: from stack.json)"
    )
    p.add_argument("--json-only", action="store_true", help="write only report.json (the series, no PNGs or HTML)")
    p.set_defaults(func=_run, parser=p)


def _run(args: argparse.Namespace) -> int:
    from slipstream.run.report import run

    return run(args)
