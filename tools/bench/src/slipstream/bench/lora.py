"""`slipstream bench lora`: LoRA against full fine-tuning at matched steps, and bytes per published version.

Learning: the default demo's task and warm-start on the tiny model (3-letter `reverse`, warm-
started to 20% greedy train accuracy: a recipe where full fine-tuning learns), then the same
number of GRPO steps twice per seed from the same warm-started base — once training every
weight, once training only LoRA adapters on the frozen base — with the learner's own `Trainer`
(each step takes `groups_per_step` groups whose rewards differ, drawing tasks until it has them,
as the learner does), rollouts from a `TorchEngine` that gets each new version in flight
(adapters only for LoRA, as a worker does), and held-out accuracy before and after, sampled
and greedy. "Within noise" is judged from the seed spread measured here: the two modes' mean
held-out gains differ by less than twice the pooled per-seed standard deviation of the gains,
and both modes must gain in every seed (so two runs that learn nothing do not pass).

Bytes: one optimizer step of SmolLM2-135M (full: every weight; LoRA: adapters), each version
encoded by the weight codec against the one before (bf16, zstd), as the weight-publisher stores
it; plus the raw bf16 size of a version. Skipped with `--no-smollm2`.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import time
from typing import Any


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "lora",
        help="LoRA vs full fine-tuning (held-out gain over seeds) and bytes per published version",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", metavar="FILE", default="", help="write the results as JSON to FILE")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (default 0 1 2)")
    p.add_argument("--steps", type=int, default=60, help="GRPO steps per run (default 60, the demo's)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    p.add_argument("--alpha", type=float, default=32.0, help="LoRA alpha (default 32)")
    p.add_argument("--lora-lr", type=float, default=0.0, help="LoRA learning rate (default: 4x the full one)")
    p.add_argument("--heldout", type=int, default=128, help="held-out tasks (x2 samples) per eval (default 128)")
    p.add_argument("--no-smollm2", action="store_true", help="skip the SmolLM2 bytes-per-version part")
    p.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    result = run(args)
    print(json.dumps(result["summary"], indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


async def _train(
    base: Any, tok: Any, plan: Any, *, seed: int, steps: int, lora: tuple[int, float] | None, lr: float, heldout: int
) -> dict[str, float]:
    import torch

    from slipstream.engine import SamplingParams, TorchEngine
    from slipstream.engine.lora import attach_lora
    from slipstream.envs import get_env
    from slipstream.harness import rollout_group
    from slipstream.harness.evaluate import evaluate, greedy_params
    from slipstream.learner.config import LearnerSection
    from slipstream.learner.trainer import Trainer
    from slipstream.learner.version_state import unique_state
    from slipstream.rl import LossConfig
    from slipstream.schemas import ScoredTrajectory, scored_episode_from_v1

    torch.manual_seed(seed)
    env = get_env(plan.env, **plan.env_options)
    policy = copy.deepcopy(base)
    serving = copy.deepcopy(base)
    if lora is not None:
        for m in (policy, serving):
            attach_lora(m, rank=lora[0], alpha=lora[1], seed=seed)
    trainer = Trainer(
        policy.train(),
        LearnerSection(lr=lr, micro_batch=64, sampling_temperature=plan.temperature),
        LossConfig(type=plan.loss, loss_constant=plan.loss_constant),
        pad_id=tok.pad_id,
    )
    engine = TorchEngine(serving.eval(), tok, max_batch=64, seed=seed, allow_partial_updates=lora is not None)
    greedy = greedy_params(env)
    params = SamplingParams(temperature=plan.temperature, max_tokens=plan.max_tokens, stop=greedy.stop)
    held = env.generate("heldout", heldout, seed + 7)
    await engine.start()
    try:
        before = await evaluate(engine, tok, env, held, samples_per_task=2, params=params, concurrency=32)
        greedy_before = await evaluate(engine, tok, env, held, concurrency=64)
        # The task stream, as the task source draws it; a step takes groups_per_step groups whose
        # rewards differ (the learner drops uniform groups), drawing as many tasks as that needs.
        stream = iter(env.generate("train", steps * plan.groups_per_step * 16, seed))
        drawn = 0
        t0 = time.perf_counter()
        for step in range(steps):
            scored: list[Any] = []
            while len(scored) < plan.groups_per_step:
                batch = [next(stream) for _ in range(plan.groups_per_step)]
                drawn += len(batch)
                groups = await asyncio.gather(
                    *(rollout_group(engine, tok, env, t, group_size=plan.group_size, params=params) for t in batch)
                )
                for task, group in zip(batch, groups, strict=True):
                    scores = [env.score(task, t.completion_text) for t in group]
                    if len({s.reward for s in scores}) > 1 and len(scored) < plan.groups_per_step:
                        scored.append(
                            [
                                scored_episode_from_v1(
                                    ScoredTrajectory(trajectory=t, reward=s.reward, correct=s.correct)
                                )
                                for t, s in zip(group, scores, strict=True)
                            ]
                        )
            trainer.step(scored, version=step)
            state = {k: v.detach().clone() for k, v in unique_state(policy).items()}
            engine.apply_weights(step + 1, state)
        train_s = time.perf_counter() - t0
        after = await evaluate(engine, tok, env, held, samples_per_task=2, params=params, concurrency=32)
        greedy_after = await evaluate(engine, tok, env, held, concurrency=64)
    finally:
        await engine.stop()
    return {
        "before": before.accuracy,
        "after": after.accuracy,
        "gain": after.accuracy - before.accuracy,
        "greedy_before": greedy_before.accuracy,
        "greedy_after": greedy_after.accuracy,
        "greedy_gain": greedy_after.accuracy - greedy_before.accuracy,
        "tasks_drawn": drawn,
        "train_s": train_s,
        "version_params": sum(t.numel() for t in unique_state(policy).values()),
    }


def learning(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from slipstream.engine import build_tiny
    from slipstream.envs import get_env
    from slipstream.run.presets import demo_plan
    from slipstream.supervised.warmstart import sft_warmstart

    torch.set_num_threads(1)
    plan = demo_plan()
    lora_lr = args.lora_lr or 4 * plan.lr
    runs: dict[str, list[dict[str, float]]] = {"full": [], "lora": []}
    for seed in args.seeds:
        base, tok = build_tiny(plan.preset, seed=seed)
        env = get_env(plan.env, **plan.env_options)
        ws = sft_warmstart(
            base,
            tok,
            env,
            steps=plan.sft_steps,
            batch_size=plan.sft_batch,
            lr=plan.sft_lr,
            seed=seed,
            target_accuracy=plan.sft_target_accuracy,
        )
        for mode, lora, lr in (("full", None, plan.lr), ("lora", (args.rank, args.alpha), lora_lr)):
            out = asyncio.run(
                _train(base, tok, plan, seed=seed, steps=args.steps, lora=lora, lr=lr, heldout=args.heldout)
            )
            out["seed"] = seed
            out["warmstart_steps"] = ws["steps"]
            runs[mode].append(out)
            print(
                f"seed {seed} {mode}: held-out {out['before']:.3f} -> {out['after']:.3f} sampled, "
                f"{out['greedy_before']:.3f} -> {out['greedy_after']:.3f} greedy ({out['train_s']:.0f} s)",
                flush=True,
            )
    out_figs: dict[str, Any] = {}
    for key in ("gain", "greedy_gain"):
        gains = {m: [r[key] for r in rs] for m, rs in runs.items()}
        means = {m: statistics.fmean(g) for m, g in gains.items()}
        stds = {m: statistics.stdev(g) if len(g) > 1 else 0.0 for m, g in gains.items()}
        pooled = ((stds["full"] ** 2 + stds["lora"] ** 2) / 2) ** 0.5
        diff = means["lora"] - means["full"]
        out_figs[key] = {
            "mean": means,
            "std": stds,
            "pooled_std": pooled,
            "mean_diff": diff,
            "within_noise": abs(diff) < 2 * pooled if pooled > 0 else diff == 0,
            "both_learn_every_seed": all(g > 0 for g in gains["full"] + gains["lora"]),
        }
    sampled = out_figs["gain"]
    return {
        "env": plan.env,
        "steps": args.steps,
        "full_lr": plan.lr,
        "lora_lr": lora_lr,
        "rank": args.rank,
        "alpha": args.alpha,
        "runs": runs,
        "mean_gain": sampled["mean"],
        "std_gain": sampled["std"],
        "pooled_std": sampled["pooled_std"],
        "mean_diff": sampled["mean_diff"],
        "within_noise": sampled["within_noise"],
        "both_learn_every_seed": sampled["both_learn_every_seed"],
        "greedy": out_figs["greedy_gain"],
        "criterion": "|mean gain(lora) - mean gain(full)| < 2 x pooled per-seed std of the gains, "
        "with full fine-tuning and LoRA both gaining in every seed",
    }


def smollm2_bytes(rank: int, alpha: float) -> dict[str, Any]:
    """Bytes of one published version of SmolLM2 after one real optimizer step, full vs LoRA."""
    import torch

    from slipstream.engine.lora import attach_lora
    from slipstream.engine.source import ModelSource, load_model
    from slipstream.envs import get_env
    from slipstream.learner.version_state import unique_state
    from slipstream.weights import encode_version

    torch.set_num_threads(2)
    env = get_env("search_call")
    out: dict[str, Any] = {}
    for mode, lr in (("full", 1e-5), ("lora", 1e-3)):
        model, tok = load_model(ModelSource(name="smollm2-135m", threads=2))
        if mode == "lora":
            attach_lora(model, rank=rank, alpha=alpha, seed=0)
        v0 = {k: v.detach().to(torch.bfloat16).clone() for k, v in unique_state(model).items()}
        tasks = env.generate("train", 4, 0)
        rows = []
        for t in tasks:
            prompt = tok.encode(tok.chat_template.render(env.chat_messages(t, t.prompt)))  # type: ignore[union-attr]
            rows.append(prompt + tok.encode(env.sft_example(t)) + [tok.eos_id])
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [tok.pad_id] * (width - len(r)) for r in rows])
        mask = (torch.arange(width)[None, :] < torch.tensor([len(r) for r in rows])[:, None]).long()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
        model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids, mask)[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), ids[:, 1:], reduction="none")
        (loss * mask[:, 1:]).sum().div(mask.sum()).backward()
        opt.step()
        v1 = {k: v.detach().to(torch.bfloat16).clone() for k, v in unique_state(model).items()}
        key = encode_version(v0, None)
        delta = encode_version(v1, v0)
        out[mode] = {
            "tensors": len(v1),
            "params": sum(t.numel() for t in v1.values()),
            "raw_bf16_bytes": delta.raw_bytes,
            "keyframe_stored_bytes": key.stored_bytes,
            "delta_stored_bytes": delta.stored_bytes,
            "changed_elements": delta.changed,
        }
        del model, opt
    out["raw_ratio_full_over_lora"] = out["full"]["raw_bf16_bytes"] / out["lora"]["raw_bf16_bytes"]
    out["delta_ratio_full_over_lora"] = out["full"]["delta_stored_bytes"] / out["lora"]["delta_stored_bytes"]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    result: dict[str, Any] = {"learning": learning(args)}
    if not args.no_smollm2:
        result["smollm2_bytes"] = smollm2_bytes(args.rank, args.alpha)
    learn = result["learning"]
    summary: dict[str, Any] = {
        "mean_gain": learn["mean_gain"],
        "std_gain": learn["std_gain"],
        "mean_diff": learn["mean_diff"],
        "pooled_std": learn["pooled_std"],
        "within_noise": learn["within_noise"],
        "both_learn_every_seed": learn["both_learn_every_seed"],
        "greedy": learn["greedy"],
    }
    if "smollm2_bytes" in result:
        b = result["smollm2_bytes"]
        summary["smollm2_version_bytes"] = {
            m: {"raw_bf16": b[m]["raw_bf16_bytes"], "delta_stored": b[m]["delta_stored_bytes"]}
            for m in ("full", "lora")
        }
    summary["seconds"] = round(time.monotonic() - t0, 1)
    result["summary"] = summary
    return result
