"""`slipstream train RUN.toml`: one experiment, described by one run file, on the local stack.

The run file (libs/run, `slipstream.run.runfile`) names the model, the environment, the
algorithm, batch and eval sizes, replicas and where NATS/Redis/the store are; this command
resolves it into a training plan and runs it with the live view and the summary, exactly as
`slipstream demo` runs its built-in plan. The file is checked before anything starts: an unknown
key or a wrong type is an error naming the key, the file and the line.

    slipstream train examples/arith.toml
    slipstream train examples/arith.toml --print-config     # what the run sets, per service
    slipstream train examples/arith.toml --print-config full  # every field of every service's config
    slipstream train examples/arith.toml --env-file run.env # the run as an env file (dev overlay, Tilt)
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

from slipstream.stack.spec import add_restart_arguments

# Each service's config class: what `--print-config` resolves the run into.
CONFIG_CLASSES = {
    "rollout-worker": "slipstream.rollout_worker.config:RolloutWorkerConfig",
    "reward-model": "slipstream.reward_model.config:RewardModelConfig",
    "learner": "slipstream.learner.config:LearnerConfig",
    "weight-publisher": "slipstream.weight_publisher.config:WeightPublisherConfig",
    "eval-gate": "slipstream.eval_gate.config:EvalGateConfig",
    "task-source": "slipstream.task_source.config:TaskSourceConfig",
}


def register(sub: Any) -> None:
    p = sub.add_parser(
        "train",
        help="run the experiment a run file describes (model, env, algorithm, sizes) on the local stack",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_file", type=Path, metavar="RUN.toml", help="the run file (see examples/)")
    p.add_argument(
        "--print-config",
        nargs="?",
        const="brief",
        choices=("brief", "full"),
        help="print each service's resolved config and exit: 'brief' (the default) only the fields this run "
        "sets away from the service's defaults, 'full' every field",
    )
    p.add_argument("--env-file", type=Path, metavar="FILE", help="write the run as KEY=VALUE config lines and exit")
    p.add_argument("--run-dir", type=Path, default=None, help="where logs, data and summary go")
    p.add_argument("--summary-json", type=Path, metavar="FILE", help="also write the run summary here")
    p.add_argument("--steps", type=int, default=None, help="override [batch] max_steps (a quick try of a run file)")
    p.add_argument("--heldout-tasks", type=int, default=None, help="override [eval] heldout_tasks")
    p.add_argument(
        "--model",
        default=None,
        metavar="NAME|PATH",
        help="override [model] name / path: a named model (smollm2-135m) or a local Hugging Face model directory",
    )
    p.add_argument(
        "--train-eval-tasks", type=int, default=None, help="override [eval] train_eval_tasks (0: no train-split eval)"
    )
    p.add_argument(
        "--sft-steps",
        type=int,
        default=None,
        help="override [warmstart] sft_steps and drop its settle steps: the whole warm-start's cap "
        "(a quick try of a run file)",
    )
    p.add_argument("--no-live", action="store_true", help="plain log lines instead of the live view")
    p.add_argument("--traces", action="store_true", help="write each service's spans to RUN_DIR/traces.<service>.jsonl")
    add_restart_arguments(p)
    p.set_defaults(func=run, parser=p)


def run(args: argparse.Namespace) -> int:
    from slipstream.run import RunFileError, env_file, load
    from slipstream.run.modelcheck import check_model

    try:
        run_file = load(args.run_file)
        plan = run_file.plan()
        if args.model is not None:
            plan.model = check_model(args.model)
    except (RunFileError, ValueError) as exc:
        print(f"slipstream train: {exc}", file=sys.stderr)
        return 2
    if args.steps is not None:
        plan.max_steps = args.steps
    for field, value, least in (
        ("heldout_tasks", args.heldout_tasks, 1),
        ("train_eval_tasks", args.train_eval_tasks, 0),
        ("sft_steps", args.sft_steps, 0),
    ):
        if value is None:
            continue
        if value < least:
            print(f"slipstream train: --{field.replace('_', '-')} must be >= {least}, got {value}", file=sys.stderr)
            return 2
        setattr(plan, field, value)
    if args.sft_steps is not None:
        plan.sft_settle_steps = 0  # --sft-steps caps the whole warm-start, settle steps included
    if args.env_file:
        args.env_file.write_text(env_file(run_file))
        print(f"wrote {args.env_file}")
        return 0
    if args.print_config:
        return print_config(run_file, plan, full=args.print_config == "full")
    from slipstream.cli.demo import execute
    from slipstream.stack.spec import StoreSpec, parse_nats_url, parse_redis_url, parse_store

    infra = run_file.infra
    try:
        store: StoreSpec | None = parse_store(infra.store) if infra.store else None
        nats = parse_nats_url(infra.nats_url) if infra.nats_url else None
        redis = parse_redis_url(infra.redis_url) if infra.redis_url else None
    except argparse.ArgumentTypeError as exc:
        print(f"slipstream train: {args.run_file}: [infra] {exc}", file=sys.stderr)
        return 2
    title = f"slipstream train {args.run_file}"
    return execute(plan, args, title=title, nats_url=nats, redis_url=redis, store=store)


def changed_fields(cfg: Any, default: Any) -> dict[str, Any]:
    """{"section.field": value} for each field of `cfg` that differs from `default` (one level of nesting)."""
    import msgspec

    from slipstream.runtime.config import redacted

    now, base = redacted(msgspec.to_builtins(cfg)), redacted(msgspec.to_builtins(default))
    out: dict[str, Any] = {}
    for section, fields in now.items():
        if isinstance(fields, dict) and isinstance(base.get(section), dict):
            out.update({f"{section}.{k}": v for k, v in fields.items() if base[section].get(k) != v})
        elif base.get(section) != fields:
            out[section] = fields
    return out


def print_config(run_file: Any, plan: Any, *, full: bool = False) -> int:
    """Each service's config as it would resolve for this run (defaults -> run file -> per-service).

    Brief (the default): only what the run sets away from the service's own defaults, one
    `section.field = value` a line, with the count of fields left at their defaults; `full`: every field.
    """
    import json

    from slipstream.run import service_env, service_overrides
    from slipstream.runtime.config import dump, resolve

    where = Path("<run-dir>")
    model_dir = where / "model-init"
    if plan.model:
        model_dir = Path(plan.model) if Path(plan.model).is_absolute() else Path(f"<{plan.model} in the model cache>")
    environ = service_env(plan, model_dir, where / "staging", where / "learner-outcomes.jsonl")
    environ["SLIPSTREAM_SERVICE__RUN_ID"] = run_file.name or "run"
    overrides = service_overrides(plan)
    services = dict(CONFIG_CLASSES)
    if run_file.replicas.tool_service:
        services["tool-service"] = "slipstream.tool_service.config:ToolServiceConfig"
    for service, target in services.items():
        module, _, name = target.partition(":")
        cls = getattr(importlib.import_module(module), name)
        cfg = resolve(cls, environ={**environ, **overrides.get(service, {})})
        replicas = getattr(run_file.replicas, service.replace("-", "_"), 1)
        print(f"# {service} (replicas: {replicas})")
        if full:
            print(dump(cfg))
            continue
        changed = changed_fields(cfg, resolve(cls, environ={}))
        for key, value in changed.items():
            print(f"{key} = {json.dumps(value)}")
        total = _count_fields(cfg)
        print(f"({total - len(changed)} more fields at their defaults)\n")
    if not full:
        print("<run-dir> is the run's directory, chosen when it starts; --print-config full prints every field.")
    return 0


def _count_fields(cfg: Any) -> int:
    import msgspec

    return sum(len(v) if isinstance(v, dict) else 1 for v in msgspec.to_builtins(cfg).values())
