"""`slipstream mtp-distill --out DIR [--model NAME|DIR|PRESET] [--depth 3] ...`: MTP drafts for a model.

Gives the model `--depth` multi-token-prediction modules (fresh, unless it already has that
many), self-distils them on samples the model generates itself (KL to the frozen main head at the
shifted position: `slipstream.engine.mtp_distill`), and writes the model with its modules to
`--out` as a Hugging Face directory whose config.json says `mtp_depth`. Point a run's `[model]
path` at it and set `[worker] speculative_tokens` to decode speculatively: the modules are part of
the weights, so every version the learner publishes carries them to the workers.
Prompts come from the real-model demo's task (through the chat template) for a model that has one,
else short arithmetic questions (the byte-level presets). The figures are printed and, with
`--json`, written.
"""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser(
        "mtp-distill",
        help="add MTP draft modules to a model and self-distil them (for speculative decoding)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, help="model directory to write")
    p.add_argument(
        "--model", default="smollm2-135m", help="named model, local HF directory or preset (default smollm2-135m)"
    )
    p.add_argument("--depth", type=int, default=3, help="MTP modules = draft tokens per step (default 3)")
    p.add_argument("--steps", type=int, default=300, help="distillation steps (default 300)")
    p.add_argument("--lr", type=float, default=3e-3, help="(default 3e-3)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--positions", type=int, default=1024, help="positions per step, sampled; 0 = all (default 1024)")
    p.add_argument("--prompts", type=int, default=64, help="prompts the corpus samples (default 64)")
    p.add_argument("--held-out", type=int, default=16, help="other prompts for the held-out KL (default 16)")
    p.add_argument("--samples", type=int, default=4, help="samples per corpus prompt (default 4)")
    p.add_argument("--tokens", type=int, default=96, help="tokens per sample (default 96)")
    p.add_argument("--dtype", default="float32", help="dtype the model is trained and saved in (default float32)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--json", metavar="FILE", default="", help="write the figures as JSON to FILE")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from slipstream.bench.mtp_distill import run

    return run(args)
