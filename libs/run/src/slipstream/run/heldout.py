"""Held-out evaluation of a training run's weights in this process: the initial model or any stored version.

`held_out` scores the initial weights (before the run) and each version the run follows
(follow.py) with `HeldOut`, one engine reused across versions; `HeldOutScore` is what a score
holds and the eval-curve row it makes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec

from slipstream.run.plan import TrainingPlan
from slipstream.run.summary_plan import summary_config


class HeldOutScore(msgspec.Struct):
    accuracy: float
    reward: float
    greedy: float
    invalid_call_rate: float = 0.0
    train_accuracy: float = -1.0
    train_greedy: float = -1.0
    train_invalid_call_rate: float = -1.0
    tool_calls: float = 0.0
    """Tool calls per held-out episode (sampled)."""
    metrics: dict[str, float] = {}
    """The env's own figures on the held-out episodes (sampled; `Environment.eval_metrics`)."""
    train_metrics: dict[str, float] = {}
    context: dict[str, float] = {}
    """Per episode (sampled), held-out and train: tokens over all links, sampled tokens, context restarts."""
    suites: dict[str, dict[str, float]] = {}
    """Per eval suite (plan.eval_suites): pass@1 sampled and greedy, reward, tasks (see `suite_figures`)."""

    def row(self, version: int) -> dict[str, float]:
        """The eval-curve row of this score."""
        out = {"version": version, "accuracy": self.accuracy, "reward": self.reward, "greedy": self.greedy}
        out["invalid_call_rate"] = self.invalid_call_rate
        if "heldout_sampled_tokens_per_correct" in self.context:  # Toggle's figure, version by version
            out["tokens_per_correct"] = self.context["heldout_sampled_tokens_per_correct"]
        out["tool_calls"] = self.tool_calls
        if self.train_accuracy >= 0:
            out["train_accuracy"] = self.train_accuracy
            out["train_greedy"] = self.train_greedy
            out["train_invalid_call_rate"] = self.train_invalid_call_rate
        out.update({f"heldout/{k}": v for k, v in self.metrics.items()})
        out.update({f"train/{k}": v for k, v in self.train_metrics.items()})
        for suite, figures in self.suites.items():
            out.update(
                {f"{suite}/{k}": v for k in ("pass@1_sampled", "pass@1_greedy") if (v := figures.get(k)) is not None}
            )
        return out


def _context_figures(split: str, report: Any) -> dict[str, float]:
    n = report.n or 1
    # Toggle's figure: sampled tokens per correct answer (a shorter wrong answer does not count).
    good = [k for t in report.tasks for k, ok in zip(t.sampled_tokens, t.correct, strict=False) if ok]
    return {
        f"{split}_tokens_per_episode": round(report.tokens / n, 2),
        f"{split}_sampled_tokens_per_episode": round(report.sampled_tokens / n, 2),
        f"{split}_sampled_tokens_per_correct": round(sum(good) / len(good), 3) if good else 0.0,
        f"{split}_restarts_per_episode": round(report.restarts / n, 3),
    }


class HeldOut:
    """Greedy held-out evaluation of any stored version, in this process (one engine, reused).

    Frozen agents (sub-agents) play on `frozen`, a `FrozenEngine` over `model_dir` as loaded
    (version 0), never on the version under evaluation: the workers' frozen copy (`[subagents]
    pin_version` -1) holds the same weights. A pool pinned to a later version is refused.
    """

    def __init__(self, plan: TrainingPlan, model_dir: Path) -> None:
        import copy

        from slipstream.engine import TorchEngine
        from slipstream.engine.frozen import FrozenEngine
        from slipstream.engine.interface import Engine
        from slipstream.engine.source import ModelSource, load_model, resolve_device, torch_dtype
        from slipstream.envs import get_env

        self.env = get_env(plan.env, **plan.env_options)
        # The same [model] the rollout workers load (dtype, LoRA structure), so a stored version applies as there.
        source = ModelSource(
            path=str(model_dir),
            dtype=plan.rollout_dtype,  # type: ignore[arg-type]
            device=plan.device,
            threads=0 if plan.model else 1,  # the tiny model: one thread (see warm_start)
            lora_rank=plan.lora_rank,
            lora_alpha=plan.lora_alpha,
        )
        if plan.subagent_pool_replicas > 0 and plan.subagent_pin_version != 0:
            raise ValueError(
                f"held-out evaluation plays sub-agents on the initial weights (version 0), but the run's sub-agent "
                f"pool is pinned to version {plan.subagent_pin_version}: its sub-agents would not be the trained ones"
            )
        model, self.tokenizer = load_model(source)
        frozen_model = copy.deepcopy(model)  # before any version is applied: the sub-agents' weights

        def engine_of(m: Any) -> TorchEngine:
            return TorchEngine(
                m,
                self.tokenizer,
                max_batch=64,
                max_seq_len=plan.max_seq_len or None,
                device=resolve_device(source),
                dtype=torch_dtype(source),
                allow_partial_updates=plan.lora_rank > 0,
            )

        self.engine = engine_of(model)
        # Its engine (a second KV cache) is built by the first sub-agent only.
        self.frozen: Engine = FrozenEngine(frozen_model, engine_of)
        self.tasks = self.env.generate("heldout", plan.heldout_tasks, plan.seed + 7)
        self.train_tasks = self.env.generate("train", plan.train_eval_tasks, plan.seed + 7)
        self.temperature = plan.temperature
        self.samples = plan.heldout_samples
        self.summary = summary_config(plan)
        # Eval suites (HumanEval): their first N problems, played by the same harness and engine.
        self.suites = {name: get_env(name) for name in plan.eval_suites}
        self.suite_tasks = {
            name: env.generate("heldout", plan.eval_suites[name], plan.seed) for name, env in self.suites.items()
        }

    async def evaluate(self, version: int | None = None, tensors: Any = None) -> HeldOutScore:
        """Sampled (rollout temperature) and greedy accuracy on the fixed held-out tasks."""
        from slipstream.engine import SamplingParams
        from slipstream.harness.evaluate import evaluate, greedy_params

        if tensors is not None and version is not None:
            self.engine.apply_weights(version, tensors)
        greedy = greedy_params(self.env)
        sampled = SamplingParams(temperature=self.temperature, max_tokens=greedy.max_tokens, stop=greedy.stop)
        s = await evaluate(
            self.engine,
            self.tokenizer,
            self.env,
            self.tasks,
            samples_per_task=self.samples,
            params=sampled,
            concurrency=32,
            summary=self.summary,
            frozen_engine=self.frozen,
        )
        g = await evaluate(
            self.engine,
            self.tokenizer,
            self.env,
            self.tasks,
            concurrency=64,
            summary=self.summary,
            frozen_engine=self.frozen,
        )
        score = HeldOutScore(
            accuracy=s.accuracy,
            reward=s.mean_reward,
            greedy=g.accuracy,
            invalid_call_rate=s.invalid_call_rate,
            tool_calls=s.tool_calls / s.n if s.n else 0.0,
            metrics=s.metrics,
            context=_context_figures("heldout", s),
        )
        score.context["heldout_greedy_tokens_per_correct"] = _context_figures("g", g)["g_sampled_tokens_per_correct"]
        if self.train_tasks:
            t = await evaluate(
                self.engine,
                self.tokenizer,
                self.env,
                self.train_tasks,
                samples_per_task=self.samples,
                params=sampled,
                concurrency=32,
                summary=self.summary,
                frozen_engine=self.frozen,
            )
            tg = await evaluate(
                self.engine,
                self.tokenizer,
                self.env,
                self.train_tasks,
                concurrency=64,
                summary=self.summary,
                frozen_engine=self.frozen,
            )
            score.train_accuracy, score.train_greedy = t.accuracy, tg.accuracy
            score.train_invalid_call_rate = t.invalid_call_rate
            score.train_metrics = t.metrics
            score.context.update(_context_figures("train", t))
        for name, env in self.suites.items():
            score.suites[name] = await self.suite_figures(env, self.suite_tasks[name])
        return score

    async def suite_figures(self, env: Any, tasks: list[Any]) -> dict[str, float]:
        """pass@1 of an eval suite: sampled (the mean over `samples` at the rollout temperature, the
        unbiased pass@1 estimate) and greedy, with the mean reward and the calls the episodes made."""
        from slipstream.engine import SamplingParams
        from slipstream.harness.evaluate import evaluate, greedy_params

        greedy = greedy_params(env)
        sampled = SamplingParams(temperature=self.temperature, max_tokens=greedy.max_tokens, stop=greedy.stop)
        s = await evaluate(
            self.engine,
            self.tokenizer,
            env,
            tasks,
            samples_per_task=self.samples,
            params=sampled,
            concurrency=32,
            frozen_engine=self.frozen,
        )
        g = await evaluate(self.engine, self.tokenizer, env, tasks, concurrency=64, frozen_engine=self.frozen)
        return {
            "tasks": float(len(tasks)),
            "pass@1_sampled": s.accuracy,
            "pass@1_greedy": g.accuracy,
            "reward_sampled": s.mean_reward,
            "reward_greedy": g.mean_reward,
            "invalid_call_rate": s.invalid_call_rate,
            "tool_calls_per_episode": s.tool_calls / s.n if s.n else 0.0,
            "seconds": s.seconds + g.seconds,
        }

    async def start(self) -> None:
        await self.engine.start()

    async def stop(self) -> None:
        await self.engine.stop()
        await self.frozen.stop()


async def held_out(
    plan: TrainingPlan, model_dir: Path, store_root: Path | None, manifest_key: str | None
) -> HeldOutScore:
    """Held-out scores of the initial weights or of a stored version."""
    ev = HeldOut(plan, model_dir)
    await ev.start()
    try:
        if manifest_key and store_root is not None:
            from slipstream.store import setup_store
            from slipstream.store.config import StoreConfig
            from slipstream.weights import fetch_version

            store = setup_store(StoreConfig(type="local", root=str(store_root)))
            manifest, tensors = await asyncio.to_thread(fetch_version, store, manifest_key)
            return await ev.evaluate(manifest.policy_version, tensors)
        return await ev.evaluate()
    finally:
        await ev.stop()
