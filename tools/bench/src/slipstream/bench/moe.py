"""`slipstream bench moe`, and the MoE section of `slipstream bench engine`: router replay's effect on
the train–inference log-prob mismatch.

A mixture-of-experts model (the seeded `tiny-moe` preset, or a saved MoE model directory such as
a demo run's warm-started `model/`) samples completions in the engine in bf16; the learner
recomputes every sampled token's log-prob in fp32 on the same weight values, once routing on its
own and once replaying the engine's recorded routes
(`slipstream.engine.replay_mismatch.measure_replay_mismatch`). A second row runs the engine in
fp32 as the control: there the forwards differ only in batch shape and kernel, and replay should
change next to nothing. Figures per row: sampled tokens, the share of (token, layer) expert sets
the learner would have chosen differently, and the mean / max |Δ log-prob| and the k3 mismatch
KL the learner reports, without and with replay.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "moe",
        help="train-inference log-prob mismatch on a MoE model, with and without router replay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", metavar="FILE", default="", help="write the results as JSON to FILE")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    add_moe_arguments(p)
    p.set_defaults(func=_command)


def add_moe_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of the MoE section (shared by `bench moe` and `bench engine`)."""
    g = p.add_argument_group("MoE router replay")
    g.add_argument("--no-moe", action="store_true", help="skip the MoE router-replay mismatch section")
    g.add_argument(
        "--moe-model", default="tiny-moe", help="MoE preset name or saved MoE model directory (default tiny-moe)"
    )
    g.add_argument("--moe-seeds", type=int, nargs="+", default=[0, 1, 2], help="sampling seeds (default 0 1 2)")
    g.add_argument("--moe-requests", type=int, default=16, help="completions per seed (default 16)")
    g.add_argument("--moe-new", type=int, default=48, help="tokens sampled per completion (default 48)")


def _command(args: argparse.Namespace) -> int:
    result = {"bench": "moe", "moe_replay": moe_section(args)}
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")
    return 0


def moe_section(args: argparse.Namespace) -> dict[str, Any] | None:
    """Mismatch rows for bf16 and fp32 engines (None with --no-moe), printed as a table."""
    if args.no_moe:
        return None
    import torch

    from slipstream.engine.loading import load_pretrained
    from slipstream.engine.presets import PRESETS, build_tiny
    from slipstream.engine.replay_mismatch import measure_replay_mismatch

    device = getattr(args, "device", "cpu")
    rows: list[dict[str, Any]] = []
    for dtype in (torch.bfloat16, torch.float32):
        for seed in args.moe_seeds:
            if args.moe_model in PRESETS:
                model, _ = build_tiny(args.moe_model, seed=seed)
            else:
                model, _ = load_pretrained(args.moe_model, dtype=torch.float32, device="cpu")
            row = measure_replay_mismatch(
                model,
                seed=seed,
                requests=args.moe_requests,
                max_tokens=args.moe_new,
                engine_dtype=dtype,
                device=device,
            )
            rows.append({"seed": seed, **row})
    print(f"MoE router replay ({args.moe_model}): engine dtype vs fp32 learner, per sampled token")
    print(f"{'engine':>9} {'seed':>4} {'tokens':>6} {'flips':>7} {'|d|mean off':>11} {'|d|mean on':>10} "
          f"{'|d|max off':>10} {'|d|max on':>9} {'kl off':>9} {'kl on':>9}")  # fmt: skip
    for r in rows:
        off, on = r["no_replay"], r["replay"]
        print(
            f"{r['engine_dtype']:>9} {r['seed']:>4} {r['tokens']:>6} {r['route_flip_share']:>7.4f} "
            f"{off['mean_abs_logprob_diff']:>11.2e} {on['mean_abs_logprob_diff']:>10.2e} "
            f"{off['max_abs_logprob_diff']:>10.2e} {on['max_abs_logprob_diff']:>9.2e} "
            f"{off['mismatch_kl']:>9.2e} {on['mismatch_kl']:>9.2e}"
        )
    return {"model": args.moe_model, "device": device, "rows": rows}
