"""`slipstream up`: start the local stack, wait until every service is ready, supervise until Ctrl-C.

A service that crashes is restarted with backoff (`slipstream.stack.supervisor`), its restarts
counted in stack.json; one that keeps crashing is given up on. `--no-restart` ends the stack at
the first death instead.

Exit codes: 0 after an orderly stop (SIGINT/SIGTERM), 1 when the stack could not become ready, a
service was given up on, a server died, or (with --no-restart) a process died (unless
--keep-going), 2 for bad arguments, 130 when interrupted while starting.

`--hosts N` (N >= 3, root only) runs the stack on N network-namespace hosts instead of loopback
(slipstream.stack.multihost): a 3-node JetStream cluster with every stream replicated 3 times,
Redis with a replica and Sentinel, the services spread over the hosts; it prints where each
process runs. Stopping it (Ctrl-C, SIGTERM) stops everything and removes the namespaces, their
links and the bridge. Where namespaces cannot be made it says why and exits 2.
Only argparse is imported at module level so `slipstream --help` stays instant.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream.stack.spec import (
    StackSpec,
    add_stack_arguments,
    non_negative_int,
    parse_nats_url,
    parse_redis_url,
    parse_store,
    spec_from_args,
)

if TYPE_CHECKING:
    from rich.console import Console

    from slipstream.stack.local import Stack

SUPERVISE_INTERVAL_S = 0.5


def register(sub: Any) -> None:
    p = sub.add_parser(
        "up",
        help="start NATS, Redis, the object store and the services; Ctrl-C stops everything",
        description=(
            "Start an embedded nats-server (JetStream), redis-server, a local object store and the six "
            "services as processes on free loopback ports; wait for every /readyz; write RUN_DIR/stack.json "
            "and .slipstream/current; supervise until SIGINT/SIGTERM (a crashed service is restarted with "
            "backoff, as a cluster would), then stop services, Redis and NATS. With --subagent-pool N, N replicas "
            "of the frozen sub-agent pool start first, pinned to --pin-version."
        ),
    )
    add_stack_arguments(p)
    p.add_argument(
        "--run",
        type=Path,
        metavar="RUN.toml",
        help="configure the services from a run file (its knobs, and [infra] servers unless flags give them)",
    )
    p.add_argument(
        "--subagent-pool",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="start N replicas of the frozen sub-agent pool (rollout workers pinned to --pin-version); the workers "
        "then send frozen sub-agents to them over NATS (default: the run file's [replicas] subagent-pool, else 0)",
    )
    p.add_argument(
        "--pin-version",
        type=non_negative_int,
        default=0,
        metavar="V",
        help="the weight version every pool replica loads and keeps (default 0: [model]'s initial weights)",
    )
    p.add_argument(
        "--hosts",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="run on N (>= 3) network-namespace hosts with a 3-node JetStream cluster and Redis with Sentinel, the "
        "services spread over them (root only); stopping removes the namespaces",
    )
    p.add_argument(
        "--keep-going", action="store_true", help="report a process that dies but keep the rest running (exit 0)"
    )
    p.set_defaults(func=run, parser=p)


def run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args, args.parser)
    if args.run is not None:
        spec = with_run_file(spec, args.run, args.parser)
    if args.subagent_pool is not None:
        spec = dataclasses.replace(spec, subagent_pool=args.subagent_pool)
    spec = dataclasses.replace(spec, pin_version=args.pin_version, hosts=args.hosts)
    if args.hosts:
        from slipstream.stack.hosts import unavailable
        from slipstream.stack.multihost import MIN_HOSTS

        if args.hosts < MIN_HOSTS:
            args.parser.error(f"--hosts must be at least {MIN_HOSTS} (a 3-node JetStream cluster), got {args.hosts}")
        if spec.nats_url or spec.redis_url:
            args.parser.error("--hosts starts its own NATS cluster and Redis failover set; drop --nats-url/--redis-url")
        if why := unavailable():
            args.parser.error(f"--hosts needs network namespaces, unavailable here: {why}")

    from rich.console import Console
    from rich.markup import escape

    from slipstream.cli.health_table import health_table
    from slipstream.stack.local import StackError, StackInterrupted
    from slipstream.stack.multihost import HostsStack, open_stack
    from slipstream.stack.signals import StopSignals

    console = Console(highlight=False, soft_wrap=True)
    stack = open_stack(spec, log=lambda msg: console.print(f"[dim]·[/dim] {msg}"))
    with StopSignals(stack.interrupt, stack.force_stop):
        console.print(f"slipstream up: run [bold]{stack.spec.run_id}[/bold] in {stack.spec.run_dir}")
        try:
            try:
                stack.start()
                took = stack.wait_ready()
            except StackInterrupted:
                console.print("interrupted while starting; stopping")
                return 130
            except StackError as exc:
                console.print(f"[red]slipstream up: {escape(str(exc))}[/red]")
                for name, tail in exc.tails.items():
                    console.rule(f"last lines of {name}'s log")
                    console.print(tail or "(empty)", markup=False)
                return 1
            state = stack.write_state()
            console.print(health_table(stack.health()))
            if isinstance(stack, HostsStack):
                console.print(where_table(stack.where()))
            console.print(
                f"ready in {took:.1f} s; logs in {stack.spec.log_dir}/<name>.log; state in {state}\n"
                "Ctrl-C stops everything" + (" (--keep-going: deaths are reported only)" if args.keep_going else "")
            )
            return _supervise(stack, console, keep_going=args.keep_going)
        finally:
            # Every way out (signal, death, error, a bug above) stops what was started.
            codes = stack.stop()
            servers = [h.name for h in reversed(stack.servers.values()) if h.managed]
            done = [f"{n} (exit {c})" for n, c in codes.items()] + servers
            console.print("stopped" + (": " + ", ".join(done) if done else ""))
            restarted = {n: c for n, c in stack.restarts.items() if c}
            if restarted:
                console.print("restarts: " + ", ".join(f"{n} {c}" for n, c in restarted.items()))


def where_table(rows: list[dict[str, Any]]) -> Any:
    """Which host each process of a `--hosts` stack runs on."""
    from rich.table import Table

    table = Table(title="where each process runs")
    for col in ("process", "host", "namespace", "address", "pid"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["name"], str(r["host"]), r["netns"], r["address"], str(r["pid"]))
    return table


def _supervise(stack: Stack, console: Console, *, keep_going: bool) -> int:
    """Watch (and restart) the processes until a stop is requested; 1 at the first final death unless keep_going.

    With restarts on, a service that ends with exit 0 has finished its work (the learner at
    max_steps) and the rest keep running; a crash is restarted inside `poll_exits`.
    """
    from rich.markup import escape

    while not stack.interrupt.sleep(SUPERVISE_INTERVAL_S):
        for name, code in stack.poll_exits():
            if code == 0 and stack.spec.restart.enabled and name in stack.services:
                console.print(f"{name} finished (exit code 0)")
                continue
            console.print(f"[red]{escape(stack.exit_message(name, code))}[/red]")
            console.rule(f"last lines of {name}'s log")
            console.print(stack.tail(name) or "(empty)", markup=False)
            if not keep_going:
                return 1
    return 0


def with_run_file(spec: StackSpec, path: Path, parser: argparse.ArgumentParser) -> StackSpec:
    """The stack `spec` configured by a run file: its knobs under any --env, its [infra] under the flags."""
    from slipstream.run import RunFileError, load, run_env

    try:
        run_file = load(path)
        env = run_env(run_file.plan())
        infra = run_file.infra
        nats = spec.nats_url or (parse_nats_url(infra.nats_url) if infra.nats_url else None)
        redis = spec.redis_url or (parse_redis_url(infra.redis_url) if infra.redis_url else None)
        store = spec.store or (parse_store(infra.store) if infra.store else None)
    except (RunFileError, ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(f"--run: {exc}")
    return dataclasses.replace(
        spec,
        env={**env, **spec.env},
        nats_url=nats,
        redis_url=redis,
        store=store,
        tool_services=run_file.replicas.tool_service,
        subagent_pool=run_file.replicas.subagent_pool,
    )
