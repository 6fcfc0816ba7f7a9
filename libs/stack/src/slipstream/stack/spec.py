"""What a local stack is made of: `StackSpec`, the CLI flags that build it, and their validation.

`slipstream up`, `slipstream demo` and the e2e tests describe a stack the same way: which
services, which servers (started here or given by URL), which object store, where the run's
files go. Everything here is pure (no processes, no sockets) so it is cheap to import from the
argument parser and to unit-test; `slipstream.stack.local` turns a spec into processes.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from slipstream.stack.supervisor import NO_RESTART, RestartPolicy

# Canonical names (as in services/<name>/ and DESIGN.md), in start order: consumers of the
# weights first is not needed since every service waits for its own streams.
SERVICES: tuple[str, ...] = (
    "rollout-worker",
    "reward-model",
    "learner",
    "weight-publisher",
    "eval-gate",
    "task-source",
)

TOOL_SERVICE = "tool-service"
"""Started only when a run asks for replicas of it (`StackSpec.tool_services`), never by --services."""

SUBAGENT_POOL = "subagent-pool"
"""Replicas of the frozen sub-agent pool: the rollout-worker service with `[pool] subagents = true`,
connecting as its own bus user; started only when asked for (`StackSpec.subagent_pool`)."""

HOME = Path(".slipstream")
"""Per-checkout state: runs/<timestamp>/ and the `current` pointer to the latest run."""

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_ENV_KEY = re.compile(r"^SLIPSTREAM_[A-Z0-9_]+__[A-Z0-9_]+$")


def module_of(service: str) -> str:
    """The Python module a service runs as: `reward-model` -> `slipstream.reward_model`."""
    if service == SUBAGENT_POOL:
        service = "rollout-worker"  # the pool is the rollout-worker service in its [pool] mode
    return "slipstream." + service.replace("-", "_")


def pool_replica_names(n: int) -> tuple[str, ...]:
    """Process names of `n` sub-agent pool replicas: `subagent-pool`, `subagent-pool-2`, ..."""
    return tuple(SUBAGENT_POOL if i == 0 else f"{SUBAGENT_POOL}-{i + 1}" for i in range(n))


def tool_replica_names(n: int) -> tuple[str, ...]:
    """Process names of `n` tool-service replicas: `tool-service`, `tool-service-2`, ..."""
    return tuple(TOOL_SERVICE if i == 0 else f"{TOOL_SERVICE}-{i + 1}" for i in range(n))


PUBLISHER = "weight-publisher"


def publisher_names(ranks: int) -> tuple[str, ...]:
    """Process names of one weight-publisher per learner rank: `weight-publisher` (rank 0), `weight-publisher-1`, ..."""
    return tuple(PUBLISHER if r == 0 else f"{PUBLISHER}-{r}" for r in range(max(ranks, 1)))


def ranks_in(env: Mapping[str, str]) -> int:
    """The learner's ranks that config variables ask for (SLIPSTREAM_LEARNER__RANKS, default 1)."""
    raw = env.get("SLIPSTREAM_LEARNER__RANKS", "1").strip() or "1"
    try:
        ranks = int(raw)
    except ValueError:
        raise ValueError(f"SLIPSTREAM_LEARNER__RANKS={raw!r} is not a whole number") from None
    if ranks < 1:
        raise ValueError(f"SLIPSTREAM_LEARNER__RANKS={raw!r} must be >= 1")
    return ranks


def publisher_rank(name: str) -> int:
    """The learner rank a weight-publisher process serves (`weight-publisher-1` -> 1)."""
    return 0 if name == PUBLISHER else int(name.removeprefix(PUBLISHER + "-"))


def kind_of(name: str) -> str:
    """The service a process name runs (`tool-service-2` -> `tool-service`, `weight-publisher-1` -> its kind)."""
    if name.startswith(TOOL_SERVICE):
        return TOOL_SERVICE
    if name.startswith(SUBAGENT_POOL):
        return SUBAGENT_POOL
    return PUBLISHER if name.startswith(PUBLISHER) else name


@dataclass(frozen=True)
class StoreSpec:
    """The object store every service shares: a local directory or an S3 bucket/prefix."""

    type: Literal["local", "s3"]
    root: str = ""
    url: str = ""
    endpoint_url: str = ""

    def env(self) -> dict[str, str]:
        """SLIPSTREAM_STORE__* variables (fields of slipstream.store.config.StoreConfig)."""
        if self.type == "local":
            return {"SLIPSTREAM_STORE__TYPE": "local", "SLIPSTREAM_STORE__ROOT": self.root}
        out = {"SLIPSTREAM_STORE__TYPE": "s3", "SLIPSTREAM_STORE__URL": self.url}
        if self.endpoint_url:
            out["SLIPSTREAM_STORE__ENDPOINT_URL"] = self.endpoint_url
        return out

    def describe(self) -> str:
        if self.type == "local":
            return self.root
        return self.url + (f" @ {self.endpoint_url}" if self.endpoint_url else "")


@dataclass(frozen=True)
class StackSpec:
    """Everything needed to start one local stack. Paths are made absolute by `normalized()`."""

    run_dir: Path
    services: tuple[str, ...] = SERVICES
    nats_url: str | None = None
    redis_url: str | None = None
    store: StoreSpec | None = None
    traces: Path | None = None
    run_id: str = ""
    ready_timeout_s: float = 120.0
    drain_timeout_s: float = 20.0
    env: Mapping[str, str] = field(default_factory=dict)
    service_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Extra config variables for one service only (service name -> variables), applied over `env`."""
    home: Path = HOME
    commands: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Per-service argv replacing `python -m slipstream.<pkg>` (a profiler, a test double)."""
    tool_services: int = 0
    """tool-service replicas started (before the services) when a run asks for them; 0: none."""
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    """How crashed services are restarted (`NO_RESTART`: a death is reported and nothing restarts)."""
    secure: bool = True
    """Servers started here get one user per service (NATS permissions, Redis ACLs) with fresh passwords."""
    learner_ranks: int = 1
    """The learner's ranks ([learner] ranks): with N > 1, one weight-publisher per rank is started
    (`weight-publisher`, `weight-publisher-1`, ...), each told its rank and the learner's."""
    subagent_pool: int = 0
    """Sub-agent pool replicas (`subagent-pool`, `subagent-pool-2`, ...) started before the services,
    each pinned to `pin_version`; with any, the rollout workers send frozen sub-agents to them
    (`[subagents] transport = "nats"`). 0: sub-agents run in the workers, on a frozen local copy."""
    pin_version: int = 0
    """The weight version every pool replica loads and keeps ([pool] pin_version; 0: [model] itself)."""
    hosts: int = 0
    """0: every process on this machine's loopback. N >= 3: N network-namespace hosts (root only) with a
    3-node JetStream cluster, Redis with a replica and Sentinel, and the services spread over them
    (`multihost.HostsStack`)."""

    def process_names(self) -> tuple[str, ...]:
        """Every service process, in start order: a weight-publisher per learner rank in place of one."""
        out: list[str] = []
        for name in self.services:
            out.extend(publisher_names(self.learner_ranks) if name == PUBLISHER else (name,))
        return tuple(out)

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"

    @property
    def data_dir(self) -> Path:
        return self.run_dir / "data"

    def normalized(self) -> StackSpec:
        """Absolute paths, a run id and a store filled in (local directory under the run by default)."""
        run_dir = self.run_dir.expanduser().resolve()
        store = self.store or StoreSpec(type="local", root=str(run_dir / "data" / "store"))
        if store.type == "local":
            store = StoreSpec(type="local", root=str(Path(store.root).expanduser().resolve()))
        return StackSpec(
            run_dir=run_dir,
            learner_ranks=self.learner_ranks if self.learner_ranks > 1 else ranks_in(self.env),
            services=self.services,
            nats_url=self.nats_url,
            redis_url=self.redis_url,
            store=store,
            traces=self.traces.expanduser().resolve() if self.traces else None,
            run_id=self.run_id or run_dir.name,
            ready_timeout_s=self.ready_timeout_s,
            drain_timeout_s=self.drain_timeout_s,
            env=dict(self.env),
            service_env={k: dict(v) for k, v in self.service_env.items()},
            home=self.home.expanduser().resolve(),
            commands={k: tuple(v) for k, v in self.commands.items()},
            tool_services=self.tool_services,
            restart=self.restart,
            secure=self.secure,
            subagent_pool=self.subagent_pool,
            pin_version=self.pin_version,
            hosts=self.hosts,
        )

    def traces_file(self, service: str) -> Path | None:
        """One span file per service (`traces.jsonl` -> `traces.reward-model.jsonl`).

        Separate files because several processes appending to one file can interleave lines
        longer than the pipe-atomic size; readers glob `<stem>.*<suffix>`.
        """
        if self.traces is None:
            return None
        return self.traces.with_name(f"{self.traces.stem}.{service}{self.traces.suffix}")


# ---- argument types: each raises ArgumentTypeError with a message naming what was wrong ----


def parse_services(raw: str) -> tuple[str, ...]:
    """`a,b,c` -> canonical names in start order; `all` (every service) or `none` (servers only).

    Both spellings are accepted (`reward-model`, `reward_model`).
    """
    text = raw.strip().lower()
    if text == "none":
        return ()
    if text in ("", "all"):
        return SERVICES
    wanted: list[str] = []
    for part in text.split(","):
        name = part.strip().replace("_", "-")
        if not name:
            continue
        if name not in SERVICES:
            raise argparse.ArgumentTypeError(
                f"unknown service {part.strip()!r}; valid names: {', '.join(SERVICES)} (or 'all', 'none')"
            )
        if name not in wanted:
            wanted.append(name)
    if not wanted:
        raise argparse.ArgumentTypeError(f"no service named in {raw!r}; valid names: {', '.join(SERVICES)}")
    return tuple(s for s in SERVICES if s in wanted)


def parse_store(raw: str) -> StoreSpec:
    """A directory path (local store) or `s3://bucket/prefix`."""
    text = raw.strip()
    if not text:
        raise argparse.ArgumentTypeError("empty store; give a directory or s3://bucket/prefix")
    if "://" not in text:
        return StoreSpec(type="local", root=text)
    parts = urlsplit(text)
    if parts.scheme != "s3":
        raise argparse.ArgumentTypeError(
            f"unsupported store URL scheme {parts.scheme!r} in {raw!r}; give a directory or s3://bucket/prefix"
        )
    bucket = parts.netloc
    if not bucket:
        raise argparse.ArgumentTypeError(f"store URL {raw!r} has no bucket; expected s3://bucket/prefix")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise argparse.ArgumentTypeError(
            f"store URL {raw!r}: {bucket!r} is not a valid S3 bucket name "
            "(3-63 characters: lowercase letters, digits, '.', '-')"
        )
    if parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(f"store URL {raw!r}: a query or fragment is not allowed")
    prefix = parts.path.strip("/")
    return StoreSpec(type="s3", url=f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}")


def parse_http_url(raw: str) -> str:
    """An S3-compatible endpoint: http(s)://host[:port]."""
    parts = urlsplit(raw.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"endpoint {raw!r} is not an http(s)://host[:port] URL")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"endpoint {raw!r}: {exc}") from None
    return raw.strip().rstrip("/")


def _server_url(raw: str, schemes: tuple[str, ...], what: str) -> str:
    parts = urlsplit(raw.strip())
    if parts.scheme not in schemes or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{what} URL {raw!r} must look like {schemes[0]}://host:port")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{what} URL {raw!r}: {exc}") from None
    return raw.strip()


def parse_nats_url(raw: str) -> str:
    return _server_url(raw, ("nats", "tls"), "NATS")


def parse_redis_url(raw: str) -> str:
    return _server_url(raw, ("redis", "rediss"), "Redis")


def parse_env(raw: str) -> tuple[str, str]:
    """`SLIPSTREAM_<SECTION>__<FIELD>=value`: extra config for the services, as env vars only."""
    key, sep, value = raw.partition("=")
    key = key.strip()
    if not sep or not _ENV_KEY.match(key):
        raise argparse.ArgumentTypeError(
            f"--env {raw!r}: expected SLIPSTREAM_<SECTION>__<FIELD>=VALUE (e.g. SLIPSTREAM_TELEMETRY__LOG_LEVEL=debug)"
        )
    return key, value


def positive_float(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{raw!r} must be > 0")
    return value


def default_run_dir(home: Path = HOME, now: float | None = None) -> Path:
    """`<home>/runs/<YYYYmmdd-HHMMSS>`, with a suffix when that second is taken."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    base = home / "runs" / stamp
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{stamp}-{n}")
    return candidate


def add_restart_arguments(parser: argparse.ArgumentParser) -> None:
    """`--no-restart` and `--max-restarts`: how `up`, `demo` and `train` treat a crashed service."""
    g = parser.add_argument_group("restarts")
    g.add_argument(
        "--no-restart",
        action="store_true",
        help="do not restart a crashed service: report it and end the run (the behaviour before restarts)",
    )
    g.add_argument(
        "--max-restarts",
        type=non_negative_int,
        default=RestartPolicy().max_restarts,
        metavar="N",
        help=(
            f"restarts of one service allowed within {RestartPolicy().window_s:.0f} s before giving up "
            f"(backoff {RestartPolicy().backoff_s:g} s, doubling, at most {RestartPolicy().max_backoff_s:g} s; "
            f"default {RestartPolicy().max_restarts})"
        ),
    )


def restart_policy(args: argparse.Namespace) -> RestartPolicy:
    """The policy `add_restart_arguments`' flags describe."""
    if getattr(args, "no_restart", False):
        return NO_RESTART
    return RestartPolicy(max_restarts=getattr(args, "max_restarts", RestartPolicy().max_restarts))


def non_negative_int(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{raw!r} must be >= 0")
    return value


def add_stack_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `up` and `demo` share."""
    g = parser.add_argument_group("stack")
    g.add_argument(
        "--run-dir",
        type=Path,
        metavar="DIR",
        help="run directory: logs/<name>.log, data/, stack.json (default: .slipstream/runs/<timestamp>)",
    )
    g.add_argument(
        "--run-id", default="", metavar="ID", help="SLIPSTREAM_SERVICE__RUN_ID (default: the run dir's name)"
    )
    g.add_argument(
        "--services",
        type=parse_services,
        default=SERVICES,
        metavar="A,B,C",
        help=f"services to start: a subset of {','.join(SERVICES)}, 'all' (default) or 'none'",
    )
    g.add_argument(
        "--nats-url",
        type=parse_nats_url,
        metavar="URL",
        help="use this NATS (JetStream) server instead of starting one; it is left running",
    )
    g.add_argument(
        "--redis-url",
        type=parse_redis_url,
        metavar="URL",
        help="use this Redis instead of starting one; it is left running",
    )
    g.add_argument(
        "--store",
        type=parse_store,
        metavar="PATH|s3://BUCKET/PREFIX",
        help="object store (default: a directory under the run dir)",
    )
    g.add_argument(
        "--s3-endpoint",
        type=parse_http_url,
        metavar="URL",
        help="S3-compatible endpoint for an s3:// store (credentials from the AWS_* env)",
    )
    g.add_argument(
        "--traces",
        type=Path,
        metavar="FILE",
        help="write spans as JSON lines, one file per service: FILE=traces.jsonl -> traces.<service>.jsonl",
    )
    g.add_argument(
        "--env",
        type=parse_env,
        action="append",
        default=[],
        metavar="SLIPSTREAM_S__F=V",
        help="extra config for every service, as a config env var (repeatable)",
    )
    g.add_argument(
        "--ready-timeout",
        type=positive_float,
        default=120.0,
        metavar="S",
        help="seconds to wait for every /readyz (default: 120)",
    )
    g.add_argument(
        "--drain-timeout",
        type=positive_float,
        default=20.0,
        metavar="S",
        help="services' drain budget on stop (SLIPSTREAM_SERVICE__DRAIN_TIMEOUT_S), then SIGKILL (default: 20)",
    )
    add_restart_arguments(parser)


def spec_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> StackSpec:
    """Cross-flag checks (reported through `parser.error`) and the spec the flags describe."""
    store: StoreSpec | None = args.store
    if args.s3_endpoint:
        if store is None or store.type != "s3":
            parser.error("--s3-endpoint needs an S3 store: --store s3://bucket/prefix")
        store = StoreSpec(type="s3", url=store.url, endpoint_url=args.s3_endpoint)
    return StackSpec(
        run_dir=args.run_dir or default_run_dir(),
        services=tuple(args.services),
        nats_url=args.nats_url,
        redis_url=args.redis_url,
        store=store,
        traces=args.traces,
        run_id=args.run_id,
        ready_timeout_s=args.ready_timeout,
        drain_timeout_s=args.drain_timeout,
        env=dict(args.env),
        restart=restart_policy(args),
    )
