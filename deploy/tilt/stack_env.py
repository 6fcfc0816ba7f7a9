"""Run a service with the embedded stack's URLs in its environment (`tilt up -- --local`).

Why: `slipstream up --services none` starts NATS and Redis on free ports and records them in its
run directory's stack.json; a Tilt local_resource cannot know those ports when the Tiltfile is
evaluated. This wrapper waits for stack.json, maps the URLs it finds onto the services' config
variables (SLIPSTREAM_BUS__URL, SLIPSTREAM_SERVICE__REDIS_URL; a value already set in the
environment wins), adds the run's manifest-signing key and its trusted public key when the stack
recorded them (`trust`: the publisher signs, every verifier checks), the score-signing key and
its public half likewise (the reward-model signs, the learner checks), and, when the stack runs
its servers with one user per service (`credentials_file`), the credentials of the service the
command runs (`-m slipstream.<pkg>`: its NATS user and its Redis ACL user), then execs the command.

Usage: python deploy/tilt/stack_env.py .slipstream/tilt/stack.json [--timeout 60] -- python -m slipstream.learner
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

# Config variable <- URL schemes that identify the server in stack.json.
TARGETS: dict[str, tuple[str, ...]] = {
    "SLIPSTREAM_BUS__URL": ("nats://", "tls://"),
    "SLIPSTREAM_SERVICE__REDIS_URL": ("redis://", "rediss://"),
}
REQUIRED = ("SLIPSTREAM_BUS__URL",)
STOPPED_STATES = ("stopped", "failed")


class StackFileError(ValueError):
    """stack.json is missing, unreadable, or does not name exactly one server of a kind."""


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, Mapping):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)


def stack_urls(doc: Any) -> dict[str, str]:
    """The config variables the stack document provides: one URL per server kind, by scheme."""
    found: dict[str, str] = {}
    for var, schemes in TARGETS.items():
        urls = sorted({s for s in _strings(doc) if s.startswith(schemes)})
        if len(urls) > 1:
            raise StackFileError(f"stack file names several {schemes[0]} URLs ({', '.join(urls)}); expected one")
        if urls:
            found[var] = urls[0]
    missing = [v for v in REQUIRED if v not in found]
    if missing:
        raise StackFileError(f"stack file has no {TARGETS[missing[0]][0]} URL (needed for {missing[0]})")
    return found


def service_of(command: list[str]) -> str | None:
    """The service a command runs: `python -m slipstream.reward_model` -> `reward-model`."""
    for flag, module in itertools.pairwise(command):
        if flag == "-m" and module.startswith("slipstream."):
            return module.removeprefix("slipstream.").replace("_", "-")
    return None


def _with_user(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def credentials_env(doc: Any, service: str | None) -> dict[str, str]:
    """The service's own NATS and Redis users, from the stack's credentials file (none: no users)."""
    path = doc.get("credentials_file") if isinstance(doc, Mapping) else None
    if not path or service is None:
        return {}
    try:
        creds = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise StackFileError(f"cannot read the stack's credentials {path}: {exc}") from exc
    if service not in creds.get("nats", {}):
        raise StackFileError(f"the stack's credentials have no NATS user {service!r}")
    out = {"SLIPSTREAM_BUS__USER": service, "SLIPSTREAM_BUS__PASSWORD": creds["nats"][service]}
    redis_pw = creds.get("redis", {}).get(service)
    redis_url = stack_urls(doc).get("SLIPSTREAM_SERVICE__REDIS_URL")
    if redis_pw and redis_url:
        out["SLIPSTREAM_SERVICE__REDIS_URL"] = _with_user(redis_url, service, redis_pw)
    return out


def service_env(doc: Any, environ: Mapping[str, str], service: str | None = None) -> dict[str, str]:
    """`environ` plus the stack's URLs (and `service`'s credentials), without overriding what is already set."""
    env = dict(environ)
    for var, value in credentials_env(doc, service).items():
        env.setdefault(var, value)
    for var, url in stack_urls(doc).items():
        env.setdefault(var, url)
    trust = doc.get("trust") if isinstance(doc, Mapping) else None
    if isinstance(trust, Mapping) and trust.get("signing_key"):
        # Only the publisher reads signing_key ([trust] of the other services ignores it locally).
        env.setdefault("SLIPSTREAM_TRUST__SIGNING_KEY", str(trust["signing_key"]))
        env.setdefault("SLIPSTREAM_TRUST__TRUSTED_KEYS", json.dumps(list(trust.get("trusted_keys") or [])))
    if isinstance(trust, Mapping) and trust.get("score_signing_key"):
        # The reward-model signs scores with it; only the learner reads the trusted list ([provenance]).
        env.setdefault("SLIPSTREAM_PROVENANCE__SIGNING_KEY", str(trust["score_signing_key"]))
        env.setdefault("SLIPSTREAM_PROVENANCE__TRUSTED_KEYS", json.dumps(list(trust.get("score_trusted_keys") or [])))
    return env


def wait_for(path: Path, timeout_s: float) -> Any:
    """The parsed stack file, once it exists and is complete JSON (it may be mid-write)."""
    deadline = time.monotonic() + timeout_s
    last = "it does not exist"
    while time.monotonic() < deadline:
        try:
            doc = json.loads(path.read_text())
            # `slipstream up` rewrites the file with state "stopped" on exit; those URLs are dead.
            if not (isinstance(doc, dict) and doc.get("state") in STOPPED_STATES):
                return doc
            last = f"the stack it describes is {doc['state']}"
        except FileNotFoundError:
            last = "it does not exist"
        except json.JSONDecodeError as exc:
            last = f"it is not complete JSON yet ({exc})"
        time.sleep(0.2)
    raise StackFileError(f"{path}: gave up after {timeout_s:.0f} s: {last}; is the `stack` resource running?")


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: stack_env.py STACK_JSON [--timeout S] -- COMMAND...", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="stack_env.py")
    parser.add_argument("stack_json", type=Path)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command:
        parser.error("no command after --")
    try:
        env = service_env(wait_for(args.stack_json, args.timeout), os.environ, service_of(command))
    except StackFileError as exc:
        print(f"stack_env.py: {exc}", file=sys.stderr)
        return 1
    os.execvpe(command[0], command, env)
    return 0  # not reached: execvpe replaces this process


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
