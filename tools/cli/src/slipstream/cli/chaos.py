"""`slipstream chaos`: a training run under a schedule of faults, and the counts that must stay at zero.

Runs the demo's training (`run_training`, the same local stack) and, as the learner's steps
come in, applies one fault after another, each `--gap` steps after the previous one settled:

- `inject`: from outside, on every subject of the subject table (tasks, both trajectory
  streams, weights.announce/promoted, eval.result, learner.step): garbage, an unknown schema
  version, and garbage just under the bus's size limit; with tool-service replicas, a garbage
  request to one of the env's tools too. Consumers must dead-letter them (the DLQ streams are
  read back);
- `kill:<service>`: SIGKILL each pipeline service in turn; the supervisor restarts it;
- `forge`: weight announces nobody should act on: a version far ahead with no manifest, the
  newest version under a fencing token nobody was granted, and an unsigned manifest;
- `restart:nats`: nats-server stopped and started again on its port and JetStream store;
- `restart:redis`: Redis stopped and started again empty;
- `permission`: services' own users publish where the subject table says they may not (a
  reward-model on traj.raw, a worker on traj.scored and weights.announce, ...) and an outsider
  connects without credentials: the server must refuse each;
- `corrupt`: bytes flipped in a stored shard of a version before the workers fetch it (they
  are paused while it is stored, then resumed): they must refuse it on its sha256;
- `stop:tool-service`: one tool-service replica stopped for good (only with replicas: an env
  whose tools can run in the tool-service, `lookup` or `search`, runs two by default).

`--env reverse` (the default) runs the demo's plan; `--env search` runs a chaos-sized plan of its
own (CHAOS_PLANS: a fixed 500-step warm-start, two groups of 8 a step, a lower learning rate;
40 steps one apart), sized so the whole schedule fits on two loaded cores while the groups keep
earning varied rewards.

`--hosts 3` (root, network namespaces) runs the same training on three namespace hosts with a
3-node JetStream cluster (every stream replicated 3 times) and Redis with Sentinel, the learner,
the reward-model and the rollout worker each on another host, and its own faults
(slipstream.chaos.hosts_faults): `kill:nats-leader` (SIGKILL the node leading the trajectory
streams, restarted after), `cut:worker-host` (the worker's host off the bridge for 10 s, then
healed), `kill:redis-primary` (Sentinel promotes the replica; the old primary returns as its
replica) and `roll:nats` (each node stopped and started again, one by one); each fault's times to
recover are in the JSON's `hosts.recovery`. Default 40 steps, gap 2: at 24 the run ended during
the roll; at 40 the four faults had settled by step ~25 (tools/chaos/README.md has the run).
`--ranks 2` trains on 2 learner ranks placed on a Ray cluster across the hosts (head on host 0,
a worker node on host 1) and adds `kill:ray-worker` (SIGKILL the worker node: the learner exits,
is restarted, and resumes on both hosts once the node is back) to the schedule.

Each fault is logged with its step, time and outcome (slipstream.chaos.faults applies them). After the
run the suite reads the run's own records back (slipstream.chaos.audit and .accounting): the
trajectory tap's ids, the learner's outcome log, the JetStream store (dead letters, what is left
in the streams, the announce log), the signed manifests, the workers' logs and the supervisor's
restart counts; it prints the figures and writes them as JSON (`--json FILE`, and
RUN_DIR/chaos.json). Exit 0 only when the run finished, every fault was applied and every
"must be 0" is 0.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from slipstream.chaos.faults import FAULTS
from slipstream.chaos.hosts_faults import HOST_FAULTS, RAY_FAULTS

HOSTS_SCHEDULE = (40, 2)
"""Default (--steps, --gap) with --hosts: four faults, each settled within two steps, two apart."""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "chaos",
        help="a training run under a schedule of faults; prints and writes the counts that must be 0",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the figures here (always RUN_DIR/chaos.json)")
    p.add_argument(
        "--env",
        default=None,
        help="environment (default reverse; lookup and search, whose tools can run in the tool-service, add two "
        "tool-service replicas; search runs its chaos-sized plan)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="learner steps (default 60, search 40; the whole schedule needs ~40 at --gap 2, ~30 at --gap 1)",
    )
    p.add_argument("--seed", type=int, default=None, help="run seed")
    p.add_argument(
        "--gap",
        type=int,
        default=None,
        help="learner steps between one fault settling and the next (default 2, search 1)",
    )
    p.add_argument("--first-at", type=int, default=2, help="learner step of the first fault")
    p.add_argument(
        "--faults",
        default=None,
        help=f"comma-separated schedule, applied in this order (default: {','.join(FAULTS)}; with --hosts: "
        f"{','.join(HOST_FAULTS)})",
    )
    p.add_argument(
        "--tool-services",
        type=int,
        default=None,
        help="tool-service replicas (default 2 when the env's tools can run there: lookup, search; else 0)",
    )
    p.add_argument("--groups-per-step", type=int, default=None, help="groups per learner step (default the demo's)")
    p.add_argument("--run-dir", type=Path, default=None, help="where logs, data and chaos.json go")
    p.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="run on this many network-namespace hosts (3 or more; root only) with a JetStream cluster and "
        "Redis with Sentinel, under the hosts' faults",
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="learner ranks (with --hosts: 2 or more put them on a Ray cluster across the hosts and add "
        f"{','.join(RAY_FAULTS)} to the schedule)",
    )
    p.set_defaults(func=run, parser=p)


def run(args: argparse.Namespace) -> int:
    from slipstream.chaos.suite import SCHEDULES, chaos_plan, parse_faults, run_chaos
    from slipstream.stack.spec import default_run_dir

    if args.hosts:
        from slipstream.stack.hosts import unavailable
        from slipstream.stack.multihost import MIN_HOSTS

        if args.hosts < MIN_HOSTS:
            args.parser.error(f"--hosts must be at least {MIN_HOSTS} (a 3-node JetStream cluster), got {args.hosts}")
        if why := unavailable():
            args.parser.error(f"--hosts needs network namespaces, unavailable here: {why}")
    if args.ranks < 1 or (args.ranks > 1 and args.hosts and args.ranks > args.hosts):
        args.parser.error(f"--ranks must be >= 1 and, with --hosts, at most the hosts; got {args.ranks}")
    ray_faults = RAY_FAULTS if args.hosts and args.ranks > 1 else ()
    known = HOST_FAULTS + ray_faults if args.hosts else FAULTS
    try:
        faults = parse_faults(args.faults or ",".join(known), known)
    except ValueError as exc:
        args.parser.error(str(exc))
    env = args.env or "reverse"
    steps, gap = HOSTS_SCHEDULE if args.hosts else SCHEDULES.get(env, (60, 2))
    steps = args.steps if args.steps is not None else steps
    gap = args.gap if args.gap is not None else gap
    if steps < 1 or gap < 1 or args.first_at < 1:
        args.parser.error("--steps, --gap and --first-at must be >= 1")
    plan = chaos_plan(args.env, steps, args.seed, args.tool_services)
    plan.learner_ranks = args.ranks
    if args.groups_per_step:
        plan.groups_per_step = args.groups_per_step
    run_dir = args.run_dir or default_run_dir()
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f} s] {msg}", flush=True)

    head = f"slipstream chaos: {plan.max_steps} steps on {plan.env}, gap {gap}"
    head += f", {args.hosts} hosts" if args.hosts else ""
    log(f"{head}, faults {','.join(faults)}; run dir {run_dir}")
    out = run_chaos(plan, run_dir, faults, gap=gap, first_at=args.first_at, log=log, hosts=args.hosts)
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(
        "chaos: " + ("PASSED" if out["passed"] else "FAILED") + f"; must be 0: {out.get('must_be_zero', 'not audited')}"
    )
    return 0 if out["passed"] else 1
