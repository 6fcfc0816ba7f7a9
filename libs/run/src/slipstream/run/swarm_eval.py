"""Evaluating one arm of `slipstream demo --env swarm` (issue 32): its model, in its own mode.

An arm is a model trained in its own right, the swarm orchestrator or the single agent: its
warm-start (`model_dir`) and, where a run's object store holds them, its last RL version. Two
evaluations, both on the env's held-out split, sampled at the plan's rollout temperature, with
the swarm's sub-agents on a frozen engine holding the arm's warm-start (the version they were
pinned to in training):

- `evaluate_arm`: the warm-start ("before") and the last version ("after") on held-out and
  train tasks: accuracy, perf, critical steps, sub-agents and parallel rate per episode, the
  wall-clock latency per episode in seconds (`latency_s`, the env's `wall_ms` count), episodes
  over the budget;
- `budget_curve`: accuracy against the critical-step budget B = 2 .. N + 2 for each item count
  N, one evaluation per (N, B) with `item_counts = [N]`, `max_critical_steps = B` and at least
  N + 2 orchestrator turns, so a serial agent is stopped by the budget only (the
  policy sees B in its step line, so each budget is its own run, not a cut of one run), written as
  JSON and plotted by `plot_budget`;
- `ceiling` (swarm mode): the teacher's orchestrator made parallel on every task (one turn
  creating and assigning all N, then the answer) over the arm's frozen sub-agents: the accuracy
  an orchestrator could reach at the budget with these sub-agents, which RL does not train. A
  swarm's accuracy is the product of its sub-agents' per-item successes, so this bounds what RL on
  the orchestrator can earn.

Tasks come from one generator for both modes (the draws do not depend on `mode`), so both arms
see the same items; only the single agent's prompt carries its mode token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIGURES = (
    "accuracy",
    "perf",
    "critical_steps",
    "total_steps",
    "subagents",
    "parallel_rate",
    "latency_s",
    "finish_rate",
    "over_budget",
)
Emit = Callable[[str], None]


@dataclass(frozen=True)
class ArmModel:
    """One arm's model: its warm-start directory and the run whose last version is "after"."""

    mode: str
    env_options: dict[str, Any]
    model_dir: Path
    store_root: Path | None = None
    run_id: str = ""


def budgets(n: int) -> list[int]:
    """The critical-step budgets of the curve at N items: 2 .. N + 2 (a serial agent finishes from N + 1)."""
    if n < 1:
        raise ValueError(f"item count must be >= 1, got {n}")
    return list(range(2, n + 3))


class _Engines:
    """The policy engine (the arm's version under evaluation) and the frozen one (its warm-start)."""

    def __init__(self, arm: ArmModel, max_seq_len: int) -> None:
        from slipstream.engine import TorchEngine
        from slipstream.engine.source import ModelSource, load_model

        source = ModelSource(path=str(arm.model_dir), threads=1)
        policy_model, self.tokenizer = load_model(source)
        frozen_model, _ = load_model(source)
        limit = max_seq_len or None
        self.policy = TorchEngine(policy_model, self.tokenizer, max_batch=64, max_seq_len=limit, device="cpu")
        self.frozen = TorchEngine(frozen_model, self.tokenizer, max_batch=64, max_seq_len=limit, device="cpu")
        self.arm = arm

    async def __aenter__(self) -> _Engines:
        await self.policy.start()
        await self.frozen.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.policy.stop()
        await self.frozen.stop()

    async def load_last(self) -> int | None:
        """Apply the run's last version to the policy engine; its number, or None (no run or version)."""
        from slipstream.store import setup_store
        from slipstream.store.config import StoreConfig
        from slipstream.weights import fetch_version, latest_version, manifest_key

        if self.arm.store_root is None:
            return None
        store = setup_store(StoreConfig(type="local", root=str(self.arm.store_root)))
        version = latest_version(store, self.arm.run_id)
        if version is None:
            return None
        manifest, tensors = await asyncio.to_thread(fetch_version, store, manifest_key(self.arm.run_id, version))
        self.policy.apply_weights(manifest.policy_version, tensors)
        return int(version)

    async def measure(
        self, env: Any, tasks: list[Any], samples: int, temperature: float, policy: Any = None
    ) -> dict[str, float]:
        """`policy` (default: the policy engine) plays the orchestrator, the frozen engine the sub-agents."""
        from slipstream.engine import SamplingParams
        from slipstream.harness.evaluate import evaluate, greedy_params

        greedy = greedy_params(env)
        params = SamplingParams(temperature=temperature, max_tokens=greedy.max_tokens, stop=greedy.stop)
        r = await evaluate(
            policy if policy is not None else self.policy,
            self.tokenizer,
            env,
            tasks,
            samples_per_task=samples,
            params=params,
            concurrency=32,
            frozen_engine=self.frozen,
        )
        row = {"accuracy": r.accuracy, "reward": r.mean_reward, **r.metrics}
        return {k: round(float(v), 4) for k, v in row.items()}


def line(row: dict[str, Any]) -> str:
    return ", ".join(f"{k} {row[k]:.3f}" for k in FIGURES if k in row)


def _env(arm: ArmModel, **override: Any) -> Any:
    from slipstream.envs import get_env

    # every evaluated task at the plan's budget (max_critical_steps), train tasks too
    return get_env("swarm", **{**arm.env_options, "mode": arm.mode, "train_budgets": [], **override})


async def _evaluate_arm(arm: ArmModel, plan: Any, tasks_n: int, samples: int, seed: int, emit: Emit) -> dict[str, Any]:
    env = _env(arm)
    tasks = {split: env.generate(split, tasks_n, seed) for split in ("heldout", "train")}
    out: dict[str, Any] = {"mode": arm.mode, "tasks": tasks_n, "samples": samples}
    async with _Engines(arm, plan.max_seq_len) as engines:
        for stage in ("before", "after"):
            if stage == "after":
                version = await engines.load_last()
                out["version"] = version
                if version is None:
                    break
            for split, ts in tasks.items():
                t0 = time.monotonic()
                row = await engines.measure(env, ts, samples, plan.temperature)
                out[f"{stage}/{split}"] = row
                emit(f"{arm.mode} {stage} {split}: {line(row)} ({time.monotonic() - t0:.0f} s)")
    return out


def evaluate_arm(
    arm: ArmModel, plan: Any, *, tasks: int, samples: int, seed: int, emit: Emit = print
) -> dict[str, Any]:
    """The arm's warm-start and last version on `tasks` held-out and train tasks (see the module docstring)."""
    return asyncio.run(_evaluate_arm(arm, plan, tasks, samples, seed, emit))


async def _ceiling(arm: ArmModel, plan: Any, tasks_n: int, samples: int, seed: int, emit: Emit) -> dict[str, Any]:
    from slipstream.supervised import ScriptedEngine

    if arm.mode != "swarm":
        raise ValueError(f"ceiling: the teacher's parallel orchestrator is the swarm's, not mode {arm.mode!r}")
    env = _env(arm, expert_parallel_rate=1.0)
    out: dict[str, Any] = {"mode": arm.mode, "tasks": tasks_n, "samples": samples}
    async with _Engines(arm, plan.max_seq_len) as engines:
        for split in ("heldout", "train"):
            tasks = env.generate(split, tasks_n, seed)

            def reply(_request: Any, context: str, tasks: list[Any] = tasks) -> str:
                # the scripted engine plays only orchestrators (the frozen engine plays sub-agents):
                # whose is told by the task prompt the context holds
                task = max((t for t in tasks if t.prompt in context), key=lambda t: len(t.prompt))
                return str(env.expert(task, context))

            teacher = ScriptedEngine(engines.tokenizer, reply, max_seq_len=plan.max_seq_len or 4096)
            t0 = time.monotonic()
            row = await engines.measure(env, tasks, samples, plan.temperature, policy=teacher)
            out[split] = row
            emit(f"ceiling {split} (teacher in parallel, its sub-agents): {line(row)} ({time.monotonic() - t0:.0f} s)")
    return out


def ceiling(arm: ArmModel, plan: Any, *, tasks: int, samples: int, seed: int, emit: Emit = print) -> dict[str, Any]:
    """The teacher's parallel orchestrator over the arm's frozen sub-agents, at the plan's budget, on
    the same held-out and train tasks as `evaluate_arm` (same `seed`): see the module docstring."""
    return asyncio.run(_ceiling(arm, plan, tasks, samples, seed, emit))


def budget_env(arm: ArmModel, n: int, budget: int) -> Any:
    """The arm's env for one point of the curve: N items, budget B, room for N sub-agents and for
    a serial agent's N + 1 turns (the turn limit must never be what stops it)."""
    return _env(
        arm,
        item_counts=[n],
        max_critical_steps=budget,
        max_subagents=max(n, arm.env_options.get("max_subagents", 4)),
        max_assign_per_turn=max(n, arm.env_options.get("max_assign_per_turn", 8)),
        max_turns=max(n + 2, arm.env_options.get("max_turns", 8)),
    )


async def _budget_curve(
    arm: ArmModel, plan: Any, ns: Sequence[int], tasks_n: int, samples: int, seed: int, last: bool, emit: Emit
) -> dict[str, Any]:
    out: dict[str, Any] = {"mode": arm.mode, "tasks": tasks_n, "samples": samples, "split": "heldout", "curves": {}}
    async with _Engines(arm, plan.max_seq_len) as engines:
        out["version"] = await engines.load_last() if last else None
        for n in ns:
            points = []
            for b in budgets(n):
                env = budget_env(arm, n, b)
                row = await engines.measure(env, env.generate("heldout", tasks_n, seed), samples, plan.temperature)
                points.append({"budget": b, **row})
                emit(f"{arm.mode} N={n} B={b}: {line(row)}")
            out["curves"][str(n)] = points
    return out


def budget_curve(
    arm: ArmModel,
    plan: Any,
    *,
    ns: Sequence[int] = (4, 8),
    tasks: int = 16,
    samples: int = 1,
    seed: int = 0,
    last: bool = True,
    emit: Emit = print,
) -> dict[str, Any]:
    """Held-out accuracy at every budget B = 2 .. N + 2 for each N in `ns`, on the arm's last version
    (`last`; its warm-start when it has none or `last` is False)."""
    return asyncio.run(_budget_curve(arm, plan, ns, tasks, samples, seed, last, emit))


def budget_figure(curves: dict[str, dict[str, Any]]) -> Any:
    """Held-out accuracy against the critical-step budget, one panel per item count N, one line per
    arm (labelled with the version it measured), the budget from which a serial agent can finish marked."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    ns = sorted({int(n) for c in curves.values() for n in c.get("curves", {})})
    if not ns:
        raise ValueError("plot_budget: no curve to plot")
    fig, axes = plt.subplots(1, len(ns), figsize=(5 * len(ns), 4), squeeze=False)
    for ax, n in zip(axes[0], ns, strict=True):
        for arm, c in sorted(curves.items()):
            points = c.get("curves", {}).get(str(n)) or []
            version = c.get("version")
            label = f"{arm} ({'v' + str(version) if version is not None else 'warm-start'})"
            ax.plot([p["budget"] for p in points], [p["accuracy"] for p in points], marker="o", label=label)
        ax.axvline(n + 1, color="grey", linestyle="--", label=f"a serial agent can finish from B = N + 1 = {n + 1}")
        ax.set_title(f"N = {n} items a task")
        ax.set_xlabel("critical-step budget B")
        ax.set_ylabel("held-out accuracy (every document found)")
        ax.set_ylim(-0.05, 1.05)
        ax.set_xticks(budgets(n))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    some = next(iter(curves.values()))
    fig.suptitle(
        "swarm vs single agent: held-out accuracy\nagainst the critical-step budget "
        f"({some.get('tasks', '?')} tasks x {some.get('samples', '?')} samples a point)"
    )
    fig.tight_layout()
    return fig


def plot_budget(curves: dict[str, dict[str, Any]], path: Path) -> Path:
    """`budget_figure` as a PNG at `path`."""
    from slipstream.run.report_figure import save

    return save(budget_figure(curves), path, dpi=100)
