"""Run a service with the embedded stack's URLs in its environment (`tilt up -- --local`).

Why: `slipstream up --services none` starts NATS and Redis on free ports and records them in its
run directory's stack.json; a Tilt local_resource cannot know those ports when the Tiltfile is
evaluated. This wrapper waits for stack.json, maps the URLs it finds onto the services' config
variables (SLIPSTREAM_BUS__URL, SLIPSTREAM_SERVICE__REDIS_URL; a value already set in the
environment wins), adds the run's manifest-signing key and its trusted public key when the stack
recorded them (`trust`: the publisher signs, every verifier checks) and execs the command.

Usage: python deploy/tilt/stack_env.py .slipstream/tilt/stack.json [--timeout 60] -- python -m slipstream.learner
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

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


def service_env(doc: Any, environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` plus the stack's URLs, without overriding what is already set."""
    env = dict(environ)
    for var, url in stack_urls(doc).items():
        env.setdefault(var, url)
    trust = doc.get("trust") if isinstance(doc, Mapping) else None
    if isinstance(trust, Mapping) and trust.get("signing_key"):
        # Only the publisher reads signing_key ([trust] of the other services ignores it locally).
        env.setdefault("SLIPSTREAM_TRUST__SIGNING_KEY", str(trust["signing_key"]))
        env.setdefault("SLIPSTREAM_TRUST__TRUSTED_KEYS", json.dumps(list(trust.get("trusted_keys") or [])))
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
        env = service_env(wait_for(args.stack_json, args.timeout), os.environ)
    except StackFileError as exc:
        print(f"stack_env.py: {exc}", file=sys.stderr)
        return 1
    os.execvpe(command[0], command, env)
    return 0  # not reached: execvpe replaces this process


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
