"""Several seeds' warm-starts of a demo plan side by side, on a GPU where there is one.

    python -m slipstream.run.warmstart_many --env swarm --arm swarm --seeds 4,5,6 --device cuda --out DIR

Each seed runs in its own process (one CPU thread each; the tiny models share the GPU) and makes
exactly the version 0 that `slipstream demo --env ENV --seed S` would warm-start (for the swarm:
`arm_plan` of the demo's plan), written to DIR/<arm>-s<seed>/model with figures.json beside it (the
warm-start's figures, the device, torch's version, the digest of the code that made it) and a log
of its probe checks. Start RL from one with `slipstream demo --env swarm --swarm-arm swarm --seed S
--init-model DIR/swarm-s<S>/model`; the demo's report then marks the warm-start as given.

Why: the swarm's cold warm-starts take 1,700-7,000 s on a 2-core CPU, and which warm-start RL
starts from decides most of what RL finds (libs/envs README, "swarm"), so the seed spread needs many
of them. A warm-start is not bit-for-bit the same across machines, devices or torch versions;
figures.json says where each was made.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def seed_plan(env: str, arm: str, seed: int, sft_steps: int | None) -> Any:
    """The demo's plan for `env` at `seed` (the swarm's arm `arm`), as `slipstream demo` makes it."""
    from slipstream.run.presets import demo_plan

    plan = demo_plan(env)
    plan.seed = seed
    if sft_steps is not None:
        plan.sft_steps = sft_steps
        plan.sft_settle_steps = 0
    if env == "swarm":
        from slipstream.run.swarm_demo import arm_plan

        plan = arm_plan(plan, arm)
    return plan


def one(env: str, arm: str, seed: int, device: str, out: Path, sft_steps: int | None) -> dict[str, Any]:
    """Warm-start one seed into out/model; returns (and writes) its figures."""
    from importlib import metadata

    from slipstream.run.training import warm_start
    from slipstream.run.warmstart import source_digest

    plan = seed_plan(env, arm, seed, sft_steps)
    t0 = time.monotonic()

    def checked(step: int, greedy: float, sampled: float) -> None:
        print(f"step {step}: probe greedy {greedy:.3f} sampled {sampled:.3f} {time.monotonic() - t0:.0f} s", flush=True)

    figures = warm_start(plan, out / "model", on_check=checked, device=device)
    figures.update(
        env=env,
        **({"arm": arm} if env == "swarm" else {}),  # other envs have no arms
        seed=seed,
        device=device,
        torch=metadata.version("torch"),
        sources=source_digest(),
        wall_s=round(time.monotonic() - t0, 1),
    )
    (out / "figures.json").write_text(json.dumps(figures, indent=1, default=str))
    return figures


def child_env() -> dict[str, str]:
    """The children's environment: JAX kept off the GPU. bm25s imports jax where it is installed,
    and jax takes 75% of a GPU's memory at its first use: on an H200 with eight warm-starts side by
    side, six of them died of CUDA out-of-memory before their first step (session 28)."""
    return {
        **os.environ,
        "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m slipstream.run.warmstart_many", description=__doc__.split("\n")[0])
    ap.add_argument("--env", default="swarm")
    ap.add_argument("--arm", default="swarm", help="the swarm's arm (swarm or single); ignored for other envs")
    ap.add_argument("--seeds", required=True, help="comma-separated seeds")
    ap.add_argument("--device", default="cpu", help="torch device of every process (cpu, cuda)")
    ap.add_argument("--sft-steps", type=int, default=None, help="cap of the warm-start (default: the plan's)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: warm-start --seeds alone
    args = ap.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if not seeds:
        ap.error("--seeds names no seed")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            ap.error(f"--device {args.device}: torch {torch.__version__} sees no GPU")
    if args.one:
        (seed,) = seeds
        one(args.env, args.arm, seed, args.device, args.out, args.sft_steps)
        return 0
    procs = []
    logs: dict[int, Any] = {}
    for seed in seeds:
        out = args.out / f"{args.arm if args.env == 'swarm' else args.env}-s{seed}"
        if (out / "figures.json").exists():
            print(f"seed {seed}: {out} already holds a warm-start, skipped", flush=True)
            continue
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "slipstream.run.warmstart_many", "--one", "--env", args.env, "--arm", args.arm]
        cmd += ["--seeds", str(seed), "--device", args.device, "--out", str(out)]
        if args.sft_steps is not None:
            cmd += ["--sft-steps", str(args.sft_steps)]
        logs[seed] = (out / "warmstart.log").open("w")
        procs.append((seed, out, subprocess.Popen(cmd, stdout=logs[seed], stderr=subprocess.STDOUT, env=child_env())))
        print(f"seed {seed}: warm-starting into {out} (pid {procs[-1][2].pid})", flush=True)
    failed = 0
    for seed, out, proc in procs:
        rc = proc.wait()
        logs.pop(seed).close()
        if rc:
            failed += 1
            print(f"seed {seed}: failed (exit {rc}); see {out / 'warmstart.log'}", flush=True)
        else:
            f = json.loads((out / "figures.json").read_text())
            probe = f"probe greedy {f.get('probe_accuracy', 0):.3f}, sampled {f.get('probe_sampled', 0):.3f}"
            print(f"seed {seed}: {f.get('steps')} steps in {f.get('wall_s')} s, {probe}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
