"""`slipstream eval VERSION`, `slipstream promote VERSION`, `slipstream rollback`: the promoted pointer by hand.

All three read the run's stack.json (`--run-dir`, default `.slipstream/current`) for the NATS,
Redis and object-store addresses and the run id, and use eval-gate's own code:

- `eval VERSION` runs the gate's evaluation of VERSION in this process (the same suite, engine
  and decision rule as the service; gate settings from `--config FILE` and SLIPSTREAM_GATE__*
  variables, the model from `--model-path`, else the run's `model-init/` when the demo made one)
  and prints the decision it would take against the promoted version (whose per-task details
  are reused from the store, or measured again when missing or from another suite). Nothing is
  written unless `--publish`, which then commits it like the service: details, `eval.result`,
  the eval history, and on promotion the pointer and `weights.promoted`.
- `promote VERSION` moves the pointer (Redis) and publishes `weights.promoted`; it refuses a
  version whose manifest is not in the object store.
- `rollback` returns to the version promoted before the current one and publishes it with
  reason "rollback": serving workers (`[worker] follow = "promoted"`) move back within seconds.

Exit codes: 0 done, 1 refused or failed (the message says why), 2 no stack.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream.cli.status import add_run_dir_argument

if TYPE_CHECKING:
    from slipstream.eval_gate.config import EvalGateConfig
    from slipstream.eval_gate.gate import Verdict
    from slipstream.stack.stackfile import StackFile


class Refused(Exception):
    """The command cannot do what was asked; the message says why."""


def register(sub: Any) -> None:
    ev = sub.add_parser(
        "eval",
        help="evaluate VERSION like eval-gate and show the decision it would take (--publish to commit it)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ev.add_argument("version", type=_version, metavar="VERSION")
    add_run_dir_argument(ev)
    ev.add_argument("--publish", action="store_true", help="record and publish the result (and promote) like the gate")
    ev.add_argument("--config", type=Path, metavar="FILE", help="eval-gate TOML with the [gate] suite and rule")
    ev.add_argument("--model-path", type=Path, metavar="DIR", help="model directory ([model] path) of the run")
    ev.add_argument("--json", action="store_true", help="print the result as JSON")
    ev.set_defaults(func=run_eval, parser=ev)

    pr = sub.add_parser("promote", help="make VERSION the promoted version; serving workers switch to it")
    pr.add_argument("version", type=_version, metavar="VERSION")
    add_run_dir_argument(pr)
    pr.add_argument("--reason", default="", help="why (kept in the promotion log and the message)")
    pr.set_defaults(func=run_promote, parser=pr)

    rb = sub.add_parser("rollback", help="go back to the previously promoted version; serving workers follow")
    add_run_dir_argument(rb)
    rb.add_argument("--reason", default="", help="why (kept in the promotion log and the message)")
    rb.set_defaults(func=run_rollback, parser=rb)


def _version(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"VERSION must be a policy version number, not {raw!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"VERSION must be >= 0, not {value}")
    return value


def _guarded(command: str, args: argparse.Namespace, body: Any) -> int:
    from slipstream.stack.status import StatusError, load_stack

    try:
        info = load_stack(args.run_dir)
    except StatusError as exc:
        print(f"slipstream {command}: {exc}")
        return 2
    from slipstream.telemetry.config import TelemetryConfig
    from slipstream.telemetry.logs import setup_logging

    # The services' log lines go to stderr (warnings only), so stdout stays the command's answer.
    setup_logging(f"slipstream-{command}", TelemetryConfig(log_format="console", log_level="warning"))
    try:
        return int(asyncio.run(body(info, args)))
    except Refused as exc:
        print(f"slipstream {command}: {exc}")
        return 1


def run_eval(args: argparse.Namespace) -> int:
    return _guarded("eval", args, _eval)


def run_promote(args: argparse.Namespace) -> int:
    return _guarded("promote", args, _promote)


def run_rollback(args: argparse.Namespace) -> int:
    return _guarded("rollback", args, _rollback)


# ---- the three commands ---------------------------------------------------------------------


def gate_config(
    info: StackFile, run_dir: Path, *, config_file: Path | None = None, model_path: Path | None = None
) -> EvalGateConfig:
    """The gate's config for this stack: file and SLIPSTREAM_* variables, with the stack's addresses on top."""
    from slipstream.eval_gate.config import EvalGateConfig
    from slipstream.runtime.config import ConfigError, resolve
    from slipstream.stack.credentials import redis_url_for

    overrides: dict[str, dict[str, Any]] = {
        "service": {"run_id": info.run_id, "redis_url": redis_url_for(info)},
        "bus": {"type": "nats", "url": info.server_url("nats"), **_bus_user(info)},
        "store": _store_fields(info),
    }
    model = model_path or (run_dir / "model-init" if (run_dir / "model-init" / "config.json").exists() else None)
    if model is not None:
        overrides["model"] = {"path": str(model)}
    try:
        return resolve(EvalGateConfig, config_file=config_file, overrides=overrides)
    except ConfigError as exc:
        raise Refused(f"gate config: {exc}") from None


def _bus_user(info: StackFile) -> dict[str, str]:
    """The admin's NATS credentials for a stack that has users (the CLI acts for the operator)."""
    from slipstream.stack.credentials import bus_config_for

    cfg = bus_config_for(info)
    return {"user": cfg.user, "password": cfg.password} if cfg.user else {}


async def _connect(info: StackFile) -> tuple[Any, Any]:
    from slipstream.bus import BusError, connect_bus
    from slipstream.control import ControlUnavailable, connect_control
    from slipstream.stack.credentials import bus_config_for, redis_url_for

    try:
        control = await connect_control(redis_url_for(info), info.run_id)
    except ControlUnavailable as exc:
        raise Refused(str(exc)) from None
    try:
        bus = await connect_bus(bus_config_for(info, connect_budget_s=3.0), name="slipstream-cli")
    except BusError as exc:
        await control.close()
        raise Refused(f"nats: {exc}") from None
    return control, bus


def _store(info: StackFile) -> Any:
    from slipstream.store import setup_store
    from slipstream.store.config import StoreConfig

    return setup_store(StoreConfig(**_store_fields(info)))


def _store_fields(info: StackFile) -> dict[str, Any]:
    """The store's fields that stack.json sets (StoreConfig's names), for the gate's config and the store."""
    s = info.store
    fields = {"type": s.type, "root": s.root, "url": s.url, "endpoint_url": s.endpoint_url}
    return {k: v for k, v in fields.items() if v}


def _manifest_key(store: Any, run_id: str, version: int) -> str:
    from slipstream.weights.layout import manifest_key

    key = manifest_key(run_id, version)
    if not store.exists(key):
        raise Refused(f"version {version} of run {run_id} has no manifest in the object store ({key})")
    return str(key)


async def _eval(info: StackFile, args: argparse.Namespace) -> int:
    from slipstream.eval_gate.evaluator import build_evaluator
    from slipstream.eval_gate.gate import Gate

    cfg = gate_config(info, args.run_dir, config_file=args.config, model_path=args.model_path)
    run_id = cfg.service.run_id
    store = _store(info)
    key = _manifest_key(store, run_id, args.version)
    control, bus = await _connect(info)
    evaluator = await build_evaluator(cfg.model, cfg.gate, store, run_id, cfg.summary)
    try:
        gate = Gate(
            cfg.gate,
            run_id=run_id,
            evaluator=evaluator,
            store=store,
            evals=control.evals,
            bus=bus,
            store_baselines=args.publish,
        )
        verdict = await gate.judge(args.version, key)
        promoted = await gate.commit(verdict) if args.publish else None
    finally:
        await evaluator.stop()
        await bus.close()
        await control.close()
    if args.json:
        print(json.dumps(_verdict_json(verdict, published=args.publish, promoted=promoted), indent=2))
    else:
        _print_verdict(verdict, published=args.publish, promoted=promoted)
    return 0


async def _promote(info: StackFile, args: argparse.Namespace) -> int:
    from slipstream.eval_gate import pointer

    run_id = info.run_id
    key = _manifest_key(_store(info), run_id, args.version)
    control, bus = await _connect(info)
    try:
        reason = "manual promote" + (f": {args.reason}" if args.reason else "")
        moved = await pointer.promote(
            control.evals, bus, run_id=run_id, version=args.version, manifest_key=key, reason=reason
        )
    finally:
        await bus.close()
        await control.close()
    if not moved.changed:
        print(f"v{moved.version} was already the promoted version; weights.promoted published again")
        return 0
    was = "nothing" if moved.previous is None else f"v{moved.previous}"
    print(f"promoted v{moved.version} (before: {was}); weights.promoted published")
    return 0


async def _rollback(info: StackFile, args: argparse.Namespace) -> int:
    from slipstream.eval_gate import pointer
    from slipstream.weights.layout import manifest_key

    run_id = info.run_id
    control, bus = await _connect(info)
    try:
        reason = "rollback" + (f": {args.reason}" if args.reason else "")
        moved = await pointer.rollback(
            control.evals, bus, run_id=run_id, manifest_key_of=lambda v: manifest_key(run_id, v), reason=reason
        )
    except pointer.PointerError as exc:
        raise Refused(str(exc)) from None
    finally:
        await bus.close()
        await control.close()
    print(f"rolled back: v{moved.previous} -> v{moved.version}; weights.promoted published")
    return 0


# ---- output ---------------------------------------------------------------------------------


def _verdict_json(verdict: Verdict, *, published: bool, promoted: bool | None) -> dict[str, Any]:
    import msgspec

    d = verdict.decision
    return {
        "result": msgspec.to_builtins(verdict.result),
        "diff": None if d.diff_mean is None else {"mean": d.diff_mean, "ci": [d.diff_ci_low, d.diff_ci_high]},
        "envs": {k: msgspec.to_builtins(v) for k, v in verdict.details.envs.items()},
        "published": published,
        "promoted": promoted,
    }


def _print_verdict(verdict: Verdict, *, published: bool, promoted: bool | None) -> None:
    from rich.console import Console
    from rich.table import Table

    r, d = verdict.result, verdict.decision
    t = Table(title=f"v{r.policy_version} on suite {r.suite!r}", title_justify="left", show_header=False)
    t.add_column("what", no_wrap=True)
    t.add_column("value")
    t.add_row("score", f"{r.score:.3f} (CI {r.ci_low:.3f}..{r.ci_high:.3f}, {r.n_samples} tasks)")
    for env, s in verdict.details.envs.items():
        t.add_row(
            f"  {env}", f"accuracy {s.accuracy:.3f}, reward {s.mean_reward:.3f}, parse failures {s.parse_failures}"
        )
    if r.baseline_version is not None and d.diff_mean is not None:
        t.add_row("promoted", f"v{r.baseline_version}: score {r.baseline_score or 0.0:.3f}")
        t.add_row("diff", f"{d.diff_mean:+.3f} (CI {d.diff_ci_low:+.3f}..{d.diff_ci_high:+.3f})")
    else:
        t.add_row("promoted", "none to compare with")
    colour = "green" if d.promote else "red"
    reason = r.reason.removeprefix(f"{r.decision}: ")
    t.add_row("decision", f"[{colour}]{r.decision}[/{colour}]: {reason}")
    if published:
        t.add_row("published", "eval.result + eval history" + (" + promoted" if promoted else ""))
    else:
        t.add_row("published", "no (dry run; --publish commits it)")
    Console(highlight=False, soft_wrap=True).print(t)
