"""`slipstream bench learner`: trained tokens/s of the learner at 1 and N ranks, and what packing balances.

The same synthetic steps (seeded; groups whose completion lengths differ from task to task, as
real tasks' answers do) are trained by the learner's ranks as the service opens them
(`open_ranks`): one rank in this process (torch threads: `--threads`, by default as many as the
most ranks timed, so both use as many cores) and N FSDP2 ranks on a local Ray (one CPU and one
torch thread each). Each run first takes
warm-up steps that are not timed. Trained tokens/s = trained (loss-mask) tokens of the timed
steps / their wall time; the weights are gathered to the driver once at the end, timed apart (the
service gathers once per published version).

Packing imbalance, per step, for each rank count: max/mean tokens per rank (and max/mean modelled
cost, attention's quadratic term included) when rows are packed by cost (`packing.pack`) and when
each rank takes a contiguous share of the step's groups (`packing.split_groups`).

On a machine with fewer cores than ranks x threads, N ranks are not faster: they share the
same cores and add the collectives (all-gather per layer and pass, reduce-scatter per layer).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Any


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "learner",
        help="learner tokens/s at 1 and N ranks (FSDP2 on Ray) and the sequence-packing imbalance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", metavar="FILE", default="", help="write the results as JSON to FILE")
    p.add_argument("--preset", default="25m", help="model preset (default 25m)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="rank counts to time (default 1 2)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per rank count (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--groups", type=int, default=4, help="groups per step (default 4)")
    p.add_argument("--group-size", type=int, default=8, help="trajectories per group (default 8)")
    p.add_argument("--max-completion", type=int, default=192, help="longest completion (default 192 tokens)")
    p.add_argument("--micro-batch", type=int, default=8, help="rows per forward pass (default 8)")
    p.add_argument("--seed", type=int, default=0, help="data and model seed (default 0)")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads of the single process (default: the largest rank count, so both use as many cores)",
    )
    p.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    result = run(args)
    print(json.dumps(result["summary"], indent=2))
    if args.json:
        from slipstream.bench.main import write_json

        write_json(result, args.json)
    return 0


def make_steps(n: int, *, groups: int, size: int, max_completion: int, seed: int) -> list[list[list[Any]]]:
    """`n` steps of `groups` groups: each task has its own typical answer length (log-uniform up to
    `max_completion`), its samples vary around it, rewards are 0/1 at random (never uniform)."""
    import math

    from slipstream.schemas import (
        PolicySegment,
        ScoredTrajectory,
        Trajectory,
        pack_floats,
        pack_ids,
        pack_mask,
        scored_episode_from_v1,
    )

    rng = random.Random(seed)
    steps = []
    for s in range(n):
        step = []
        for g in range(groups):
            typical = int(math.exp(rng.uniform(math.log(4), math.log(max_completion))))
            prompt_len = rng.randrange(8, 48)
            members = []
            for i in range(size):
                n_tok = max(2, min(max_completion, int(typical * rng.uniform(0.6, 1.4))))
                prompt = [1, *(rng.randrange(3, 250) for _ in range(prompt_len - 1))]
                completion = [rng.randrange(3, 250) for _ in range(n_tok - 1)] + [2]
                traj = Trajectory(
                    trajectory_id=f"s{s}g{g}e{i}",
                    task_id=f"s{s}g{g}",
                    env="bench",
                    group_id=f"s{s}g{g}/g",
                    group_size=size,
                    prompt_len=prompt_len,
                    token_ids=pack_ids(prompt + completion),
                    logprobs=pack_floats([-math.log(259.0)] * n_tok),
                    loss_mask=pack_mask([1] * n_tok),
                    segments=[PolicySegment(0, n_tok)],
                )
                reward = float(i % 2)
                members.append(scored_episode_from_v1(ScoredTrajectory(trajectory=traj, reward=reward)))
            step.append(members)
        steps.append(step)
    return steps


def _packing(steps: list[list[list[Any]]], section: Any, ranks: list[int], hidden: int) -> dict[str, Any]:
    from slipstream.learner.packing import attention_weight_for, pack, split_groups
    from slipstream.learner.trainer import step_items

    w = attention_weight_for(hidden)
    out: dict[str, Any] = {}
    for n in ranks:
        if n < 2:
            continue
        rows: dict[str, list[float]] = {"packed_tokens": [], "packed_cost": [], "groups_tokens": [], "groups_cost": []}
        for groups in steps:
            items = step_items(groups, section)
            sizes = [len(step_items([g], section)) for g in groups]
            packed = pack(items, n, attention_weight=w)
            naive = split_groups(sizes, n, items=items, attention_weight=w)
            rows["packed_tokens"].append(packed.imbalance)
            rows["packed_cost"].append(packed.cost_imbalance)
            rows["groups_tokens"].append(naive.imbalance)
            rows["groups_cost"].append(naive.cost_imbalance)
        out[str(n)] = {
            "with_packing": {
                "tokens_max_over_mean": round(statistics.mean(rows["packed_tokens"]), 4),
                "cost_max_over_mean": round(statistics.mean(rows["packed_cost"]), 4),
            },
            "without_packing": {
                "tokens_max_over_mean": round(statistics.mean(rows["groups_tokens"]), 4),
                "cost_max_over_mean": round(statistics.mean(rows["groups_cost"]), 4),
            },
            "steps": len(steps),
        }
    return out


def _time_run(trainer: Any, steps: list[list[list[Any]]], warmup: int) -> dict[str, Any]:
    times: list[float] = []
    tokens = 0
    losses: list[float] = []
    for version, groups in enumerate(steps):
        start = time.perf_counter()
        stats = trainer.step(groups, version)
        elapsed = time.perf_counter() - start
        losses.append(round(stats.loss, 6))
        if version >= warmup:
            times.append(elapsed)
            tokens += stats.n_tokens
    return {
        "trained_tokens": tokens,
        "step_s": [round(t, 3) for t in times],
        "tokens_per_s": round(tokens / sum(times), 1) if times else 0.0,
        "loss_per_step": losses,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import msgspec
    import torch

    from slipstream.engine.source import ModelSource, load_model
    from slipstream.learner.config import LearnerSection
    from slipstream.learner.group import open_ranks
    from slipstream.rl import LossConfig

    source = ModelSource(preset=args.preset, seed=args.seed, threads=1)
    steps = make_steps(
        args.warmup + args.steps,
        groups=args.groups,
        size=args.group_size,
        max_completion=args.max_completion,
        seed=args.seed,
    )
    loss = LossConfig()
    base = LearnerSection(micro_batch=args.micro_batch, seed=args.seed, lr=1e-5)
    model = load_model(source)[0]
    hidden = int(model.config.hidden_size)
    n_params = sum(p.numel() for p in model.parameters())
    runs: dict[str, Any] = {}
    for n in args.ranks:
        print(f"learner: {args.preset} at {n} rank(s) ...", flush=True)
        section = msgspec.structs.replace(base, ranks=n)
        # load_model applies [model] threads: the one rank in this process gets --threads, Ray ranks 1 each.
        threads = (args.threads or max(args.ranks)) if n == 1 else 1
        started = time.perf_counter()
        with open_ranks(msgspec.structs.replace(source, threads=threads), section, loss) as group:
            figures = {"start_s": round(time.perf_counter() - started, 2)}
            figures |= _time_run(group, steps, args.warmup)
            t0 = time.perf_counter()
            _ = group.model  # the whole policy: gathered from N ranks, at hand for one
            figures["gather_s"] = round(time.perf_counter() - t0, 3)
            figures["torch_threads"] = torch.get_num_threads() if n == 1 else 1
        runs[str(n)] = figures
        print(f"  {figures['tokens_per_s']} trained tokens/s, steps {figures['step_s']} s", flush=True)
    packing = _packing(steps, base, sorted({*args.ranks, 2, 4}), hidden)
    load = os.getloadavg()
    summary = {
        "preset": args.preset,
        "parameters": n_params,
        "tokens_per_s": {n: r["tokens_per_s"] for n, r in runs.items()},
        "packing_imbalance": {
            n: {
                "with_packing": p["with_packing"]["tokens_max_over_mean"],
                "without_packing": p["without_packing"]["tokens_max_over_mean"],
            }
            for n, p in packing.items()
        },
        # Same data and seed: every rank count should train the same steps (float tolerance).
        "max_loss_diff_vs_first": max(
            abs(a - b)
            for r in runs.values()
            for a, b in zip(r["loss_per_step"], next(iter(runs.values()))["loss_per_step"], strict=True)
        ),
        "cpus": os.cpu_count(),
        "load_average_1m": round(load[0], 2),
    }
    return {
        "summary": summary,
        "runs": runs,
        "packing": packing,
        "config": {k: v for k, v in vars(args).items() if k != "func"},
    }
