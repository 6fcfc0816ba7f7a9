"""Least privilege in Redis: one ACL user per service, limited to its keys and commands.

The table below says which control-plane keys (`keyspace.Keyspace`) each service touches and
with which commands, including the commands its Lua scripts call (Redis checks those against the
caller's ACL too). `acl_file` renders it as a Redis ACL file: the `default` user becomes the
password-protected admin (operators, the CLI, tests), every service gets a user that can reach
only its own keys of its own run, and a service with no row gets a user that can only PING. A
service outside its rights gets `NOPERM` from the server.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import quote, urlsplit, urlunsplit

from slipstream.control.keyspace import Keyspace

ADMIN = "default"
"""Redis's own default user, made the password-protected admin."""

# Every connection: liveness, and the handshake redis-py sends (refused harmlessly when absent).
_BASE = ("ping", "echo", "select", "client|setname")
# redis-py's registered scripts: EVALSHA, and SCRIPT LOAD after a Redis restart emptied the cache.
_SCRIPTS = ("evalsha", "script|load", "script|exists")


@dataclass(frozen=True)
class Access:
    """The keys (names from `Keyspace`, `*` as a glob) and commands one service may use."""

    keys: tuple[str, ...]
    commands: tuple[str, ...]


ACCESS: Mapping[str, Access] = {
    # The leader lease and its fence counter (scripts: GET/SET/INCR/PTTL/PEXPIRE/DEL), the ledger
    # (claim script: SET NX PX; MGET/GET), per-task statistics (MULTI/HINCRBY/HINCRBYFLOAT/EXEC).
    "learner": Access(
        keys=("lease", "lease:fence", "ledger:*", "task:*"),
        commands=(
            *_SCRIPTS,
            "get",
            "set",
            "mget",
            "incr",
            "pttl",
            "pexpire",
            "del",
            "multi",
            "exec",
            "hincrby",
            "hincrbyfloat",
            "hgetall",
        ),
    ),
    # The fence check only inspects the lease (script: GET/PTTL).
    "weight-publisher": Access(keys=("lease",), commands=(*_SCRIPTS, "get", "pttl")),
    # The eval history and the promotion pointer (scripts: GET/SET/DEL/RPUSH/RPOP/LINDEX); the
    # highest fence token granted, read to refuse an announce under a token never granted.
    "eval-gate": Access(
        keys=("evals", "evals:by_version", "promoted", "promoted:stack", "promoted:log", "lease:fence"),
        commands=(*_SCRIPTS, "get", "set", "del", "rpush", "rpop", "lindex", "lrange", "hget", "hset", "multi", "exec"),
    ),
    # The difficulty filter reads task statistics; announces are checked against the granted fence.
    "task-source": Access(keys=("task:*", "lease:fence"), commands=("hgetall", "get")),
    # Announces are checked against the highest fence token granted (Control.granted_fence). A
    # serving worker's pending stage (libs/serve `RedisPending`: sessions, calls, feedback and the
    # episodes waiting for it, under `serve:*`; its scripts call the hash, set and sorted-set
    # commands below).
    "rollout-worker": Access(
        keys=("lease:fence", "serve:*"),
        commands=(
            *_SCRIPTS,
            "get",
            "set",
            "exists",
            "incr",
            "pttl",
            "pexpire",
            "hget",
            "hset",
            "hsetnx",
            "hmget",
            "hvals",
            "hlen",
            "hexists",
            "hgetall",
            "hincrby",
            "zadd",
            "zrem",
            "zcard",
            "zrange",
            "zrangebyscore",
        ),
    ),
}


def key_patterns(service: str, run_id: str | None) -> tuple[str, ...]:
    """`service`'s key globs, inside one run's namespace (any run when `run_id` is None)."""
    access = ACCESS.get(service)
    if access is None:
        return ()
    prefix = Keyspace(run_id).prefix if run_id is not None else "slipstream:{*}"
    return tuple(f"{prefix}:{k}" for k in access.keys)


def user_rules(service: str, password: str, run_id: str | None = None) -> str:
    """The ACL rules of `service`'s user (everything not granted is refused)."""
    access = ACCESS.get(service, Access(keys=(), commands=()))
    rules = ["on", f">{password}", "resetkeys", "resetchannels", "-@all"]
    rules += [f"+{c}" for c in dict.fromkeys((*_BASE, *access.commands))]
    rules += [f"~{k}" for k in key_patterns(service, run_id)]
    return " ".join(rules)


def acl_file(admin_password: str, passwords: Mapping[str, str], run_id: str | None = None) -> str:
    """A Redis ACL file: the admin (`default`) and one user per service in `passwords`."""
    for name, pw in {ADMIN: admin_password, **passwords}.items():
        if not pw or any(c.isspace() for c in pw):
            raise ValueError(f"Redis password of {name!r} must be non-empty without whitespace")
    lines = [f"user {ADMIN} on >{admin_password} ~* &* +@all"]
    lines += [f"user {name} {user_rules(name, pw, run_id)}" for name, pw in sorted(passwords.items())]
    return "\n".join(lines) + "\n"


def with_user(url: str, user: str, password: str) -> str:
    """`url` (redis://, rediss:// or redis+sentinel:// with several hosts) authenticating as `user`."""
    parts = urlsplit(url)
    hosts = parts.netloc.rpartition("@")[2]  # every host:port as written, any credentials dropped
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{hosts}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def services_with_access() -> Iterable[str]:
    return ACCESS.keys()
