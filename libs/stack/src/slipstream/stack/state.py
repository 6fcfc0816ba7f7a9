"""What a running `Stack` reports: the health table's rows and stack.json's content.

Split from local.py (which starts, supervises and stops the processes): these read a stack's
servers, services and supervisor and build the health table's rows (`slipstream up`'s table) and
the `StackFile` that RUN_DIR/stack.json holds (stackfile.py), which `slipstream status` and the
other commands read back.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any, Protocol

from slipstream.stack.credentials import FILE as CREDENTIALS_FILE
from slipstream.stack.credentials import Credentials
from slipstream.stack.handles import ServerHandle, ServiceProcess
from slipstream.stack.probe import probe_http, url_endpoint
from slipstream.stack.spec import StackSpec, kind_of, module_of
from slipstream.stack.stackfile import (
    RestartPolicyEntry,
    ServerEntry,
    ServiceEntry,
    StackFile,
    StoreEntry,
    TrustEntry,
)
from slipstream.stack.supervisor import Supervisor, describe_exit

SIGNING_KEY_ENV = "SLIPSTREAM_TRUST__SIGNING_KEY"
TRUSTED_KEYS_ENV = "SLIPSTREAM_TRUST__TRUSTED_KEYS"
SCORE_SIGNING_KEY_ENV = "SLIPSTREAM_PROVENANCE__SIGNING_KEY"
SCORE_KEYS_ENV = "SLIPSTREAM_PROVENANCE__TRUSTED_KEYS"


class Reported(Protocol):
    """What stack.json is built from (a `stack.Stack` is one); declared here since the stack writes it."""

    @property
    def spec(self) -> StackSpec: ...

    @property
    def state(self) -> str: ...

    @property
    def started_at(self) -> float: ...

    @property
    def servers(self) -> Mapping[str, ServerHandle]: ...

    @property
    def services(self) -> Mapping[str, ServiceProcess]: ...

    @property
    def supervisor(self) -> Supervisor: ...

    @property
    def exit_codes(self) -> Mapping[str, int | None]: ...

    @property
    def signing_key_id(self) -> str: ...

    @property
    def trust(self) -> Mapping[str, str]: ...

    @property
    def credentials(self) -> Credentials | None: ...


def health_rows(
    servers: Mapping[str, ServerHandle], services: Mapping[str, ServiceProcess], supervisor: Supervisor
) -> list[dict[str, Any]]:
    """One row per process for the table: name, pid, url, health, log (probed now)."""
    rows: list[dict[str, Any]] = []
    for h in servers.values():
        if not h.alive():
            health = f"exited ({h.server.process.proc.poll() if h.server else '?'})"
        else:
            health = ("up" if h.reachable() else "unreachable") + ("" if h.managed else " (external)")
        rows.append({"name": h.name, "pid": h.pid, "url": h.url, "health": health, "log": h.log_path})
    for s in services.values():
        wait = supervisor.restart_in(s.name)
        if wait is not None:
            health = f"restarting in {wait:.0f} s ({describe_exit(supervisor.last_exit(s.name))})"
        elif supervisor.gave_up(s.name):
            health = f"gave up ({describe_exit(supervisor.last_exit(s.name))})"
        elif not s.alive():
            health = f"exited ({s.returncode})"
        else:
            status = probe_http(s.port, "/readyz", host=s.host, timeout_s=0.5)
            health = "ready" if status == 200 else f"not ready ({status or 'no answer'})"
        rows.append(
            {
                "name": s.name,
                "pid": s.pid,
                "url": s.url,
                "health": health,
                "log": s.process.log_path,
                "restarts": supervisor.restarts(s.name),
            }
        )
    return rows


def state_info(stack: Reported) -> StackFile:
    """What stack.json holds: later commands (`slipstream status`, ...) read it (`read_stack_file`)."""
    spec = stack.spec
    assert spec.store is not None
    return StackFile(
        state=stack.state,
        run_id=spec.run_id,
        run_dir=str(spec.run_dir),
        supervisor_pid=os.getpid(),
        started_at=time.time() - (time.monotonic() - stack.started_at),
        servers={
            h.name: ServerEntry(
                url=h.url,
                port=url_endpoint(h.url, 0)[1],
                pid=h.pid,
                managed=h.managed,
                log=str(h.log_path) if h.log_path else None,
            )
            for h in stack.servers.values()
        },
        store=StoreEntry(
            type=spec.store.type, root=spec.store.root, url=spec.store.url, endpoint_url=spec.store.endpoint_url
        ),
        services={
            s.name: ServiceEntry(
                module=module_of(kind_of(s.name)),
                pid=s.pid,
                port=s.port,
                url=s.url,
                log=str(s.process.log_path),
                traces_file=str(s.traces_file) if s.traces_file else None,
                ready_after_s=s.ready_after_s,
                restarts=stack.supervisor.restarts(s.name),
                supervisor=stack.supervisor.state(s.name),
            )
            for s in stack.services.values()
        },
        exit_codes=dict(stack.exit_codes),
        signing_key_id=stack.signing_key_id,
        # For services started beside the stack (Tilt --local): who signs, and what to trust.
        trust=TrustEntry(
            signing_key=stack.trust.get(SIGNING_KEY_ENV, ""),
            trusted_keys=json.loads(stack.trust.get(TRUSTED_KEYS_ENV, "[]")),
            score_signing_key=stack.trust.get(SCORE_SIGNING_KEY_ENV, ""),
            score_trusted_keys=json.loads(stack.trust.get(SCORE_KEYS_ENV, "[]")),
        ),
        restart_policy=RestartPolicyEntry(
            enabled=stack.spec.restart.enabled,
            max_restarts=stack.spec.restart.max_restarts,
            window_s=stack.spec.restart.window_s,
        ),
        supervisor_events=[dict(e.as_dict()) for e in stack.supervisor.events[-100:]],
        # Users per service on the servers; the admin's passwords are in this file (mode 0600).
        credentials_file=str(spec.run_dir / CREDENTIALS_FILE) if stack.credentials else None,
    )
