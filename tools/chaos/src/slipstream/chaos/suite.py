"""The chaos suite: a training run under a schedule of faults, then the audit of the counts that must stay 0.

`chaos_plan` is the demo's plan for an env with the suite's own settings (CHAOS_PLANS) and
tool-service replicas; `run_chaos` runs it under the schedule (faults.py applies each fault),
reads the run's records back (audit.py, accounting.py) and returns the figures (`figures`), also
written to RUN_DIR/chaos.json. `slipstream chaos` (tools/cli) parses the flags and calls it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slipstream.chaos.audit import audit
from slipstream.chaos.faults import FAULTS, Chaos, env_tools

NOT_COVERED = (
    "run and checked on reverse, lookup and search only: code and recall (their plans do not train yet) never were",
)
# The first `search` plans (issue 13), sized for a CPU: one hop, the BM25-only backend
# (the hybrid one's MiniLM encode costs every process tens of seconds), the question without the
# tool list, a 1,536-token budget with 420-token results and at most 4 turns. The expert finds the
# hop with grep_corpus on the clues (BM25 cannot match the decade "1870s" to a year) and is
# imperfect: on 30% of tasks its first grep names the neighbouring decade and it greps again.
# SEARCH_GREP_OPTIONS is the first plan's corpus (24 tasks per domain, one distractor each, the
# expert's grep `north. It dates from 187`): 200-1,500 warm-start steps formed the region word but
# never the decade's digits or the found document's id, whose distances from where they are copied
# varied with the text. The next plan (`fixed_offsets`): the question names the decade last and
# the grep opens with its digits (`from 187.*north`), a document opens with its year and ends with
# its id (`Id 417.`), so both copies sit a fixed distance before they are made; 225 tasks per
# domain without distractors in 12 regions with unique (region, decade) clues and random 3-digit
# ids (879 tasks, 661 train: too many to memorise), so the grep returns the target alone.
# libs/envs/README.md, "The CPU demo plan", has the probe curves. Every episode of that plan was
# two turns, one grep and no prune (issue 33): the swarm demo keeps it (its
# corpus); examples/search.toml is the plan that needs the harness.
SEARCH_GREP_OPTIONS = {
    "backend": "bm25",
    "max_hops": 1,
    "tasks_per_domain": 24,
    "distractors": 1,
    "filler_per_domain": 0,
    "budget_tokens": 1536,
    "search_tokens": 420,
    "reserve_tokens": 128,
    "max_turns": 4,
    "tools_line": False,
    "expert_grep": True,
    "expert_slip_rate": 0.3,
}
# Per-environment chaos settings, over the demo's plan (`demo_plan`, examples/<env>.toml). The suite needs the learner
# to step through the whole schedule, and GRPO/CISPO drop a group whose rewards are all equal, so
# the policy must earn varied rewards from the first step to the last; the figures are in the
# runbook (deploy/runbooks/README.md).
# `search`: the demo's env (same corpus, tools and expert); its warm-start probe (greedy replay of
# the expert's clean episodes) is not what the suite needs, so the warm-start runs a fixed length.
# Measured (seed 0, train tasks sampled after a batch-8 warm-start at lr 3e-3, load ~5-12): after
# 40, 80, 150 and 250 steps 0 of 8 groups of 8 had varied rewards at T 1.0 (malformed outputs score
# 0: 61 % of them at 250 steps); at 250 steps 4 of 64 groups of 4 at T 1.0 and 10 of 64 at T 0.7;
# after 500 steps (365 s) 49 of 64 groups of 8 at T 0.7 (mean reward 0.61, final answer found
# 0.30, malformed 0.06). So 500 steps, and T 0.7 rather than the demo's 1.0 (fewer malformed).
# Two groups of 8 per step, and lr 3e-5 so the policy stays where its groups vary for the whole
# run (at the demo's 3e-4 from a 200-step warm-start the batch reward fell 0.14 -> 0.05 in five
# steps); the suite checks the plumbing, not learning. Those figures are the first demo plan's
# corpus (SEARCH_GREP_OPTIONS), which the suite keeps; the demo's fixed_offsets corpus has no
# varied groups after 500 steps (its decade copy forms from ~800).
CHAOS_PLANS: dict[str, dict[str, Any]] = {
    "search": {
        "env_options": SEARCH_GREP_OPTIONS,
        "sft_steps": 500,
        "sft_target_accuracy": 0.0,
        "sft_settle_steps": 0,
        "sft_target_sampled": 0.0,
        "temperature": 0.7,
        "group_size": 8,
        "groups_per_step": 2,
        "lr": 3e-5,
        "heldout_tasks": 16,
    },
}
SCHEDULES: dict[str, tuple[int, int]] = {"search": (40, 1)}
"""Default (--steps, --gap) per env; (60, 2) otherwise. On search (seed 0, 32 steps at gap 1) the
last fault settled at step 30: 40 leaves room, and a step there cost ~3 s after a ~400 s warm-start."""


def parse_faults(text: str, known: tuple[str, ...] = FAULTS) -> list[str]:
    """The schedule from --faults; a name not in `known` is an error naming it."""
    names = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in names if f not in known]
    if unknown:
        raise ValueError(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(known)}")
    if not names:
        raise ValueError("--faults names no fault")
    return names


def chaos_plan(env: str | None, steps: int, seed: int | None, tool_services: int | None) -> Any:
    """The demo's plan for `env` (with CHAOS_PLANS[env] over it), sized for the suite: no periodic
    held-out evals, a small held-out set, and two tool-service replicas when the env's tools can run there."""
    from slipstream.run.presets import demo_plan

    plan = demo_plan(env)
    for name, value in CHAOS_PLANS.get(plan.env, {}).items():
        setattr(plan, name, copy.deepcopy(value))
    plan.max_steps = steps
    plan.eval_every = 0
    plan.heldout_tasks = min(plan.heldout_tasks, 32)
    plan.heldout_samples = 1
    plan.train_eval_tasks = 0
    if seed is not None:
        plan.seed = seed
    if tool_services is None:
        tool_services = 2 if env_tools(plan.env, plan.env_options) else 0
    plan.tool_service_replicas = tool_services
    return plan


def figures(chaos: Chaos, summary: Any, found: dict[str, Any]) -> dict[str, Any]:
    """The JSON the suite prints and writes."""
    from slipstream.chaos.accounting import corrupted_applied

    join = found["join"]
    genuine = sorted({r.policy_version for r in found["announces"] if r.genuine})
    forged = [{"version": r.policy_version, "why": r.why} for r in found["announces"] if not r.genuine]
    bad_applied = corrupted_applied(chaos.corrupted, found["applied"])
    must = {
        "trained_twice": join.trained_twice,
        "lost": join.lost,
        "versions_announced_twice": len(found["announced_twice"]),
        "corrupted_versions_applied": len(bad_applied),
        "publishes_outside_permissions_stored": found["impostor_announces"],
    }
    tr = summary.trajectories or {}
    finished = bool(summary.ok) and summary.steps >= chaos.plan.max_steps
    faults_ok = all(r.ok for r in chaos.records)
    balanced = bool(tr.get("accounted_raw")) and bool(tr.get("accounted_scored"))
    return {
        "passed": finished and faults_ok and balanced and not any(must.values()),
        "finished": finished,
        "error": summary.error,
        "must_be_zero": must,
        "env": chaos.plan.env,
        "steps": summary.steps,
        "max_steps": chaos.plan.max_steps,
        "gap": chaos.gap,
        "seed": chaos.plan.seed,
        "wall_time_s": round(summary.wall_time_s, 1),
        "train_time_s": round(summary.train_time_s, 1),
        "trajectories": {
            **join.as_dict(),
            "raw_stream_messages": found["raw_last_seq"],
            "scored_stream_messages": found["scored_last_seq"],
            "outside_messages_left": found["left_garbage"],
            "outside_messages_dead_lettered": found["dead_garbage"],
        },
        "injected": dict(chaos.injected),
        "dead_letters": found["dead_letters"],
        "versions": {
            "announced": len(genuine),
            "final": summary.final_version,
            "announced_twice": found["announced_twice"],
            "forged_announces_in_log": forged,
            "garbage_announces_in_log": found["garbage_announces"],
            "applied_by_workers": len({v for v, _ in found["applied"]}),
            "corrupted": sorted(chaos.corrupted),
            "refused_by_workers_on_fetch": found["refused_by_workers"],
            "corrupted_applied": bad_applied,
        },
        "restarts": dict(summary.restarts),
        "summary_accounting": {k: tr.get(k) for k in ("accounted_raw", "accounted_scored", "injected_scored")},
        "faults": [r.as_dict() for r in chaos.records],
        "not_covered": list(NOT_COVERED),
        "run_dir": summary.run_dir,
    }


def recovery(chaos: Any) -> dict[str, dict[str, Any]]:
    """Per fault, its times to recover (the `_s` figures of its detail)."""
    return {r.name: {k: v for k, v in r.detail.items() if k.endswith("_s")} for r in chaos.records}


def run_chaos(
    plan: Any,
    run_dir: Path,
    faults: list[str],
    *,
    gap: int = 2,
    first_at: int = 2,
    log: Callable[[str], None] = print,
    hosts: int = 0,
) -> dict[str, Any]:
    """One chaos run: the training under the schedule, then the audit; returns the figures (also RUN_DIR/chaos.json).

    `hosts` (>= 3, root only) runs it on namespace hosts with the hosts' faults (hosts_faults.py)."""
    from slipstream.chaos.hosts_faults import HostsChaos
    from slipstream.run.training import run_training

    chaos = (HostsChaos if hosts else Chaos)(plan, faults, gap=gap, first_at=first_at, log=log)
    run_dir = run_dir.resolve()
    summary = run_training(
        plan, run_dir, on_event=chaos.on_event, on_stack=chaos.on_stack, on_tap=chaos.on_tap, hosts=hosts
    )
    tap_ids = set(chaos.tap.ids.raw_ids) if chaos.tap is not None else set()
    trusted = chaos.stack.trusted_keys if chaos.stack is not None else []
    if isinstance(chaos, HostsChaos):
        if chaos.streams is None:
            why = chaos.stream_read_error or "the stack never started"
            summary.error = summary.error or f"the streams could not be read from the cluster: {why}"
            summary.ok = False
            out = {
                "passed": False,
                "finished": False,
                "error": summary.error,
                "faults": [r.as_dict() for r in chaos.records],
            }
            (run_dir / "chaos.json").write_text(json.dumps(out, indent=2) + "\n")
            return out
        found = audit(run_dir, run_dir.name, trusted, tap_ids, streams=chaos.streams)
    else:
        found = audit(run_dir, run_dir.name, trusted, tap_ids)
    out = figures(chaos, summary, found)
    if isinstance(chaos, HostsChaos):
        out["hosts"] = {"count": hosts, "placement": chaos.placement, "recovery": recovery(chaos)}
    (run_dir / "chaos.json").write_text(json.dumps(out, indent=2) + "\n")
    return out
