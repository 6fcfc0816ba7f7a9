"""A running local stack: servers and the five services as processes, ready-checked and stopped by PID.

`Stack(spec)` is what `slipstream up`, `slipstream demo` and the e2e tests share:

    with Stack(StackSpec(run_dir=tmp, services=("reward-model",))) as stack:
        stack.wait_ready()
        ...                                   # stack.info() has every URL, port and PID

`start()` starts nats-server (JetStream) and redis-server unless URLs were given, makes the local
store directory, then one `python -m slipstream.<pkg>` per service, configured only through
SLIPSTREAM_<SECTION>__<FIELD> variables. Each run gets its own ed25519 key (data/keys/, mode
0600): the weight-publisher signs manifests with it and every verifier trusts only its public key,
unless --env names a key of its own (SLIPSTREAM_TRUST__SIGNING_KEY / __TRUSTED_KEYS). A second
key signs scores: the reward-model signs every scored episode with it and the learner trusts only
its public half (SLIPSTREAM_PROVENANCE__SIGNING_KEY / __TRUSTED_KEYS, which --env may name too). When it
starts both servers itself (and `spec.secure`, the default), they run with one user per service
(`credentials.py`): NATS permissions and Redis ACLs from the tables, fresh passwords per run,
streams provisioned as the admin before any service starts. `stop()` sends SIGTERM to every
service at once, waits their drain budget, SIGKILLs what is left, then stops the servers it
started (Redis, then NATS) — never a server it was given by URL.

A service that crashes is started again (same port, same environment, its log appended to) by
`poll_exits()`, which `wait_ready()` and the callers' watch loops call, as the `Supervisor`
decides: backoff, a crash budget, restart counts (in stack.json, for `slipstream status`) and
events (for the live views). `StackSpec.restart = NO_RESTART` reports every death instead.
nats-server and Redis are never restarted by the supervisor; `restart_server` restarts one on
purpose (the chaos suite's fault), on the same port.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from slipstream.bus.config import BusConfig
from slipstream.bus.permissions import ADMIN
from slipstream.stack import ManagedProcess, ProcessGroup, Server, free_port, port_bindable, start_nats, start_redis
from slipstream.stack.credentials import Credentials
from slipstream.stack.handles import ServerHandle, ServiceProcess
from slipstream.stack.probe import HOST, probe_http
from slipstream.stack.signals import StopFlag
from slipstream.stack.spec import (
    SUBAGENT_POOL,
    TOOL_SERVICE,
    StackSpec,
    kind_of,
    module_of,
    pool_replica_names,
    publisher_rank,
    tool_replica_names,
)
from slipstream.stack.stackfile import FILE as STACK_FILE
from slipstream.stack.stackfile import encode_stack_file
from slipstream.stack.state import (
    SCORE_KEYS_ENV,
    SCORE_SIGNING_KEY_ENV,
    SIGNING_KEY_ENV,
    TRUSTED_KEYS_ENV,
    health_rows,
    state_info,
)
from slipstream.stack.supervisor import Supervisor, SupervisorEvent
from slipstream.trust import SigningKey, generate_keypair, load_signing_key

KILL_GRACE_S = 5.0
"""Extra wait past the services' own drain budget before SIGKILL (their shutdown needs a moment)."""

# Variables the stack sets itself; `--env` may not override them (the stack.json would lie).
OWNED_ENV = (
    "SLIPSTREAM_BUS__TYPE",
    "SLIPSTREAM_BUS__URL",
    "SLIPSTREAM_STORE__TYPE",
    "SLIPSTREAM_STORE__ROOT",
    "SLIPSTREAM_STORE__URL",
    "SLIPSTREAM_STORE__ENDPOINT_URL",
    "SLIPSTREAM_SERVICE__REDIS_URL",
    "SLIPSTREAM_SERVICE__RUN_ID",
    "SLIPSTREAM_SERVICE__HTTP_HOST",
    "SLIPSTREAM_SERVICE__HTTP_PORT",
    "SLIPSTREAM_SERVICE__DRAIN_TIMEOUT_S",
    "SLIPSTREAM_TELEMETRY__LOG_FORMAT",
    "SLIPSTREAM_TELEMETRY__TRACES",
    "SLIPSTREAM_TELEMETRY__TRACES_FILE",
)
# Also the stack's own when it makes the credentials.
OWNED_WHEN_SECURE = ("SLIPSTREAM_BUS__USER", "SLIPSTREAM_BUS__PASSWORD", "SLIPSTREAM_BUS__PASSWORD_FILE")


class StackError(RuntimeError):
    """The stack could not start or become ready; `tails` holds the last log lines of the culprits."""

    def __init__(self, message: str, tails: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.tails = tails or {}


class StackInterrupted(Exception):
    """A stop was requested (SIGINT/SIGTERM) while the stack was starting or waiting."""


class Stack:
    """One local stack. Not thread-safe; a signal handler may call `interrupt.set()` or `force_stop()`."""

    def __init__(
        self,
        spec: StackSpec,
        *,
        interrupt: StopFlag | None = None,
        log: Callable[[str], None] | None = None,
        kill_grace_s: float = KILL_GRACE_S,
        on_event: Callable[[SupervisorEvent], None] | None = None,
    ) -> None:
        self.spec = spec.normalized()
        self.kill_grace_s = kill_grace_s
        self.interrupt = interrupt or StopFlag()
        self._log = log or (lambda _msg: None)
        self._force = False
        self.group = ProcessGroup()
        self.servers: dict[str, ServerHandle] = {}
        self.services: dict[str, ServiceProcess] = {}
        self.state = "new"
        self.started_at = 0.0
        self.exit_codes: dict[str, int | None] = {}
        self._reported: set[str] = set()
        self._unclaimed: list[tuple[str, int | None]] = []
        self._state_written = False
        self._trust: dict[str, str] = {}
        self._starters: dict[str, Callable[..., Server]] = {}
        self.signing_key_id = ""
        self._on_event = on_event
        self.supervisor = Supervisor(self.spec.restart, on_event=self._supervisor_event)
        self.credentials: Credentials | None = None
        if self.spec.secure and self.spec.nats_url is None and self.spec.redis_url is None:
            tools = (TOOL_SERVICE,) if self.spec.tool_services else ()
            pool = (SUBAGENT_POOL,) if self.spec.subagent_pool else ()
            self.credentials = Credentials.generate((*self.spec.services, *tools, *pool))

    # ---- start ----

    def start(self) -> Stack:
        if self.state != "new":
            raise StackError(f"stack already {self.state}")
        self._check_buildable()
        self.state = "starting"
        self.started_at = time.monotonic()
        spec = self.spec
        try:
            spec.log_dir.mkdir(parents=True, exist_ok=True)
            spec.data_dir.mkdir(parents=True, exist_ok=True)
            self._start_servers()
            assert spec.store is not None
            if spec.store.type == "local":
                Path(spec.store.root).mkdir(parents=True, exist_ok=True)
            self._trust = self._run_key()
            # Tool-service replicas first: a worker's first tool call finds them subscribed; then the
            # sub-agent pool, whose children call the tools and whose requests the workers send.
            names = (*tool_replica_names(spec.tool_services), *pool_replica_names(spec.subagent_pool))
            for name in (*names, *spec.process_names()):
                self._check_interrupt()
                port = free_port()
                proc = self._spawn(name, port)
                self.services[name] = ServiceProcess(
                    name, port, proc, spec.traces_file(name), host=self.service_host(name)
                )
                self.supervisor.watch(name)
                self._log(f"started {name} (pid {proc.pid}, port {port})")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_servers(self) -> None:
        """NATS and Redis: given by URL, else started here (with one user per service when secure)."""
        spec, creds = self.spec, self.credentials
        if creds is None:
            self.servers["nats"] = self._server("nats", spec.nats_url, start_nats)
            self.servers["redis"] = self._server("redis", spec.redis_url, start_redis)
            return
        creds.save(spec.run_dir)
        nats_auth, redis_acl = creds.nats_authorization(), creds.redis_acl(spec.run_id)
        self.servers["nats"] = self._server(
            "nats", None, lambda d, logs, **kw: start_nats(d, logs, authorization=nats_auth, **kw)
        )
        self.servers["redis"] = self._server(
            "redis", None, lambda d, logs, **kw: start_redis(d, logs, acl=redis_acl, **kw)
        )
        self._provision(creds)

    def service_host(self, name: str) -> str:
        """The address service `name`'s HTTP port listens on (loopback here; its host's in multihost.py)."""
        return HOST

    def service_argv(self, name: str) -> list[str]:
        """The command that runs service `name` (`python -m slipstream.<pkg>` unless the spec names one)."""
        return list(self.spec.commands.get(name) or (sys.executable, "-m", module_of(kind_of(name))))

    def _spawn(self, name: str, port: int) -> ManagedProcess:
        # Call from the main thread only: the child's parent-death signal is tied to the thread
        # that forked it, so a child forked from a worker thread would die with that thread.
        proc = ManagedProcess(
            name, self.service_argv(name), self.spec.log_dir / f"{name}.log", self.service_env(name, port)
        )
        self.group.add(proc)
        return proc

    def _provision(self, creds: Credentials) -> None:
        """Create the streams and durables as the admin: the services' own users may not."""
        from slipstream.bus.provision import ProvisionConfig, provision
        from slipstream.runtime.config import build, env_layer

        # The services' stream settings (storage, replicas) come from the same variables.
        tree = env_layer(ProvisionConfig, self.spec.env)
        bus = msgspec.structs.replace(
            build(ProvisionConfig, tree, "--env").bus,
            type="nats",
            url=self.servers["nats"].url,
            user=ADMIN,
            password=creds.nats[ADMIN],
        )
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # start() may run inside an event loop
            try:
                pool.submit(asyncio.run, provision(bus)).result()
            except Exception as exc:
                raise StackError(f"cannot provision the streams as the admin user: {exc}") from exc
        self._log("provisioned streams and durables (services connect as their own users)")

    def _owned_env(self) -> tuple[str, ...]:
        return OWNED_ENV + (OWNED_WHEN_SECURE if self.credentials is not None else ())

    def _check_buildable(self) -> None:
        clash = sorted(k for k in self.spec.env if k in self._owned_env())
        if clash:
            raise StackError(f"{', '.join(clash)} is set by the stack itself; use the matching flag instead of --env")
        missing = [
            n
            for n in self.spec.services
            if n not in self.spec.commands and importlib.util.find_spec(module_of(n) + ".__main__") is None
        ]
        if missing:
            raise StackError(
                "cannot run "
                + ", ".join(f"{n} ({module_of(n)} has no __main__)" for n in missing)
                + "; is the service installed (make install)?"
            )

    def _server(self, name: str, url: str | None, starter: Callable[..., Server]) -> ServerHandle:
        self._check_interrupt()
        if url is not None:
            handle = ServerHandle(name, url, None)
            if not handle.reachable():
                raise StackError(f"{name} at {url} is not reachable (nothing listening)")
            self._log(f"using {name} at {url}")
            return handle
        server = starter(self.spec.data_dir / name, self.spec.log_dir)
        handle = ServerHandle(name, server.url, server)
        self._starters[name] = starter
        # ProcessGroup runs these last-first: Redis, then NATS (whichever process restart_server left).
        self.group.on_stop(lambda: handle.server.stop() if handle.server else None)
        self._log(f"started {name} at {server.url} (pid {server.pid})")
        return handle

    def restart_server(self, name: str, *, empty: bool = False) -> float:
        """Stop a server this stack started and start it again on the same port; returns seconds it was down.

        nats-server comes back on its JetStream store directory, so streams, consumers and their
        messages survive; `empty=True` wipes the server's data directory first (Redis restarted
        empty, as a pod without a volume would). The services reconnect on their own. The chaos
        suite's fault; call it from the main thread (a child's parent-death signal is tied to the
        thread that forked it).
        """
        handle = self.servers[name]
        old = handle.server
        if old is None:
            raise StackError(f"{name} at {handle.url} was given by URL; only a server this stack started is restarted")
        t0 = time.monotonic()
        old.stop()
        data = self.spec.data_dir / name
        if empty:
            shutil.rmtree(data, ignore_errors=True)
        handle.server = self._starters[name](data, self.spec.log_dir, port=old.port)
        down = time.monotonic() - t0
        self._log(f"restarted {name} at {handle.url} (pid {handle.pid}, down {down:.2f} s{', empty' if empty else ''})")
        if self._state_written:
            self.write_state()
        return down

    def _run_key(self) -> dict[str, str]:
        """The run's two signing keys (made once per run dir: weights, scores) and the trusted lists naming them."""
        weights, weights_path = self._key(SIGNING_KEY_ENV, "weights-signing.pem")
        scores, scores_path = self._key(SCORE_SIGNING_KEY_ENV, "scores-signing.pem")
        self.signing_key_id = weights.key_id
        return {
            SIGNING_KEY_ENV: str(weights_path),
            TRUSTED_KEYS_ENV: json.dumps([weights.public]),
            SCORE_SIGNING_KEY_ENV: str(scores_path),
            SCORE_KEYS_ENV: json.dumps([scores.public]),
        }

    def _key(self, env_name: str, file_name: str) -> tuple[SigningKey, Path]:
        """The key --env names under `env_name`, else the run's own `data/keys/<file_name>` (made on first use)."""
        given = self.spec.env.get(env_name)
        path = Path(given) if given else self.spec.data_dir / "keys" / file_name
        return (load_signing_key(path) if given or path.exists() else generate_keypair(path)), path

    def service_env(self, name: str, port: int) -> dict[str, str]:
        """The child's environment: inherited, plus the run's keys, plus --env, plus the stack's own variables."""
        spec = self.spec
        assert spec.store is not None
        env = dict(os.environ)
        if self._trust:
            env[TRUSTED_KEYS_ENV] = self._trust[TRUSTED_KEYS_ENV]
            if kind_of(name) == "weight-publisher":
                env[SIGNING_KEY_ENV] = self._trust[SIGNING_KEY_ENV]
            if kind_of(name) == "reward-model":
                env[SCORE_SIGNING_KEY_ENV] = self._trust[SCORE_SIGNING_KEY_ENV]
            if kind_of(name) == "learner":
                env[SCORE_KEYS_ENV] = self._trust[SCORE_KEYS_ENV]
        env.update(spec.env)
        kind = kind_of(name)
        if kind == SUBAGENT_POOL:
            # The rollout-worker service: the workers' own settings ([model] above all), then its mode.
            env.update(spec.service_env.get("rollout-worker", {}))
        env.update(spec.service_env.get(kind, {}))
        env.update(spec.store.env())
        env.update(
            {
                "SLIPSTREAM_BUS__TYPE": "nats",
                "SLIPSTREAM_BUS__URL": self.servers["nats"].url,
                "SLIPSTREAM_SERVICE__REDIS_URL": self.servers["redis"].url,
                "SLIPSTREAM_SERVICE__RUN_ID": spec.run_id,
                "SLIPSTREAM_SERVICE__HTTP_HOST": self.service_host(name),
                "SLIPSTREAM_SERVICE__HTTP_PORT": str(port),
                "SLIPSTREAM_SERVICE__DRAIN_TIMEOUT_S": str(spec.drain_timeout_s),
                "SLIPSTREAM_TELEMETRY__LOG_FORMAT": "json",
                # Not a config field: Python's own switch, so a dying service's last lines reach its log.
                "PYTHONUNBUFFERED": "1",
            }
        )
        if spec.learner_ranks > 1:
            # One publisher per learner rank: each stores its rank's part of every version.
            env["SLIPSTREAM_LEARNER__RANKS"] = str(spec.learner_ranks)
            if kind_of(name) == "weight-publisher":
                env["SLIPSTREAM_PUBLISHER__RANKS"] = str(spec.learner_ranks)
                env["SLIPSTREAM_PUBLISHER__RANK"] = str(publisher_rank(name))
        if kind == SUBAGENT_POOL:
            env["SLIPSTREAM_POOL__SUBAGENTS"] = "true"
            env["SLIPSTREAM_POOL__PIN_VERSION"] = str(spec.pin_version)
            env["SLIPSTREAM_SERVICE__REPLICA"] = name
        elif kind == "rollout-worker" and spec.subagent_pool > 0:
            env["SLIPSTREAM_SUBAGENTS__TRANSPORT"] = "nats"
            # The version the workers hold the pool to: a reply played on any other is rejected.
            env["SLIPSTREAM_SUBAGENTS__PIN_VERSION"] = str(spec.pin_version)
        if self.credentials is not None:
            env.update(self.credentials.service_env(kind, self.servers["redis"].url))
        traces = spec.traces_file(name)
        if traces is not None:
            env["SLIPSTREAM_TELEMETRY__TRACES"] = "file"
            env["SLIPSTREAM_TELEMETRY__TRACES_FILE"] = str(traces)
        return env

    def admin_bus(self, **kw: Any) -> BusConfig:
        """A BusConfig for this stack's NATS with the admin's rights (tests, read-outs, the CLI)."""
        url = self.servers["nats"].url
        return self.credentials.admin_bus(url, **kw) if self.credentials else BusConfig(url=url, **kw)

    def service_bus(self, service: str, **kw: Any) -> BusConfig:
        """A BusConfig that connects as `service`'s own user (as that service would)."""
        url = self.servers["nats"].url
        if self.credentials is None:
            return BusConfig(url=url, **kw)
        return BusConfig(url=url, user=service, password=self.credentials.nats[service], **kw)

    def admin_nats_options(self) -> dict[str, str]:
        """`nats.connect` keyword arguments that authenticate as the admin (empty without credentials)."""
        if self.credentials is None:
            return {}
        return {"user": ADMIN, "password": self.credentials.nats[ADMIN]}

    def admin_redis_url(self) -> str:
        url = self.servers["redis"].url
        return self.credentials.admin_redis_url(url) if self.credentials else url

    def _check_interrupt(self) -> None:
        if self.interrupt.is_set():
            raise StackInterrupted("stop requested while starting")

    # ---- readiness and supervision ----

    def wait_ready(self, timeout_s: float | None = None) -> float:
        """Block until every service's /readyz answers 200; returns seconds since start().

        Raises StackError naming the service that exited or is still not ready (with its log
        tail), StackInterrupted if a stop was requested. The stack is left running either way.
        """
        budget = self.spec.ready_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        pending = [s for s in self.services.values() if s.ready_after_s is None]
        while True:
            self._check_interrupt()
            for handle in self.servers.values():
                if not handle.alive():
                    tail = handle.server.process.tail() if handle.server else ""
                    raise StackError(f"{handle.name} exited while the stack was starting", {handle.name: tail})
            # Crashed services are restarted here as later; only a final exit ends the wait.
            for name, code in self.poll_exits():
                svc = self.services.get(name)
                if svc is not None and svc in pending:
                    raise StackError(f"{self.exit_message(name, code)} before it was ready", {name: svc.process.tail()})
                self._unclaimed.append((name, code))  # a ready one that ended: the caller's watch loop hears of it
            for svc in list(pending):
                if not svc.alive():
                    continue  # waiting for its restart
                if probe_http(svc.port, "/readyz", host=svc.host, timeout_s=0.5) == 200:
                    svc.ready_after_s = time.monotonic() - self.started_at
                    pending.remove(svc)
                    self._log(f"{svc.name} ready after {svc.ready_after_s:.1f} s")
            if not pending:
                self.state = "ready"
                return time.monotonic() - self.started_at
            if time.monotonic() >= deadline:
                names = [s.name for s in pending]
                raise StackError(
                    f"not ready after {budget:.0f} s: {', '.join(names)}", {s.name: s.process.tail() for s in pending}
                )
            self.interrupt.sleep(0.2)

    def poll_exits(self) -> list[tuple[str, int | None]]:
        """Processes (services, and servers we started) that ended for good since the last call.

        A crashed service that the supervisor restarts is not reported here (its `crashed` and
        `restarted` events go to `on_event` and the log); one that finished (exit 0), that the
        supervisor gave up on, or any death under NO_RESTART is, once. Restarts that are due
        happen during this call.
        """
        out, self._unclaimed = self._unclaimed, []
        supervising = self.spec.restart.enabled and self.state in ("starting", "ready")
        for svc in self.services.values():
            if svc.name in self._reported or svc.alive() or self.supervisor.state(svc.name) == "backoff":
                continue
            code = svc.returncode
            if not supervising or self.supervisor.state(svc.name) == "retired":
                self._reported.add(svc.name)
                out.append((svc.name, code))
                continue
            event = self.supervisor.exited(svc.name, code)
            if event.kind != "crashed":
                self._reported.add(svc.name)
                out.append((svc.name, code))
        if supervising:
            for name in self.supervisor.due():
                self._restart(self.services[name])
        for handle in self.servers.values():
            if handle.server and handle.name not in self._reported and not handle.alive():
                self._reported.add(handle.name)
                out.append((handle.name, handle.server.process.proc.poll()))
        return out

    def _restart(self, svc: ServiceProcess) -> None:
        old = svc.process
        old.stop(timeout_s=1.0)  # already dead: reaps it, kills what it left in its group, closes its log
        if old in self.group.procs:
            self.group.procs.remove(old)
        # The same port, unless something else holds it now (then each restart would fail to bind).
        if not port_bindable(HOST, svc.port):
            svc.port = free_port()
        svc.process = self._spawn(svc.name, svc.port)
        self.supervisor.restarted(svc.name, f"pid {svc.process.pid}")
        if self._state_written:
            self.write_state()  # new pid: `slipstream status` and the chaos suite read it there

    def _supervisor_event(self, event: SupervisorEvent) -> None:
        self._log(event.message())
        if self._on_event is not None:
            self._on_event(event)

    def stop_service(self, name: str, timeout_s: float) -> int | None:
        """Stop one service on purpose (SIGTERM, then SIGKILL after `timeout_s`); it is not restarted."""
        svc = self.services[name]
        self.supervisor.retire(name)
        return svc.process.stop(timeout_s)

    def exit_message(self, name: str, code: int | None) -> str:
        """`learner exited with code 1` — plus why it was not restarted when the supervisor gave up."""
        why = self.supervisor.gave_up(name)
        return why if why else f"{name} exited with code {code}"

    @property
    def trusted_keys(self) -> list[str]:
        """The public keys this stack's verifiers trust: --env's, else the run's own key."""
        text = self.spec.env.get(TRUSTED_KEYS_ENV) or self._trust.get(TRUSTED_KEYS_ENV) or "[]"
        return [str(k) for k in json.loads(text)]

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts per service so far."""
        return {n: self.supervisor.restarts(n) for n in self.services}

    def tail(self, name: str, n: int = 40) -> str:
        if name in self.services:
            return self.services[name].process.tail(n)
        handle = self.servers.get(name)
        return handle.server.process.tail(n) if handle and handle.server else ""

    def health(self) -> list[dict[str, Any]]:
        """One row per process for the table: name, pid, url, health, log (probed now)."""
        return health_rows(self.servers, self.services, self.supervisor)

    # ---- state file ----

    @property
    def trust(self) -> dict[str, str]:
        """The signing key and trusted keys the services were given (SIGNING_KEY_ENV, TRUSTED_KEYS_ENV)."""
        return self._trust

    def info(self) -> dict[str, Any]:
        """What stack.json holds, as plain data: later commands read the file as a `StackFile`."""
        return dict(msgspec.to_builtins(state_info(self)))

    def write_state(self) -> Path:
        """Write run_dir/stack.json (atomically) and point <home>/current at the run dir."""
        path = self.spec.run_dir / STACK_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(encode_stack_file(state_info(self)))
        os.replace(tmp, path)
        self._state_written = True
        home = self.spec.home
        home.mkdir(parents=True, exist_ok=True)
        try:
            target = os.path.relpath(self.spec.run_dir, home)
        except ValueError:
            target = str(self.spec.run_dir)
        link = home / "current"
        tmp_link = home / f".current.{os.getpid()}"
        try:
            if tmp_link.is_symlink() or tmp_link.exists():
                tmp_link.unlink()
            tmp_link.symlink_to(target, target_is_directory=True)
            os.replace(tmp_link, link)
        except OSError as exc:
            # The run is fine without the pointer; say why `slipstream status` will not find it.
            if tmp_link.is_symlink():
                tmp_link.unlink()
            self._log(f"warning: could not point {link} at {self.spec.run_dir}: {exc}")
        return path

    # ---- stop ----

    def force_stop(self) -> None:
        """Make a stop in progress SIGKILL now (a second Ctrl-C)."""
        self._force = True

    def stop(self) -> dict[str, int | None]:
        """Services first (SIGTERM together, drain budget, SIGKILL), then the servers we started. Idempotent."""
        if self.state == "stopped":
            return self.exit_codes
        self.state = "stopping"  # no restarts from here on
        for s in self.services.values():
            self.supervisor.retire(s.name)
        alive = [s for s in self.services.values() if s.alive()]
        if alive:
            self._log(f"stopping {len(alive)} service(s) (drain budget {self.spec.drain_timeout_s:.0f} s)")
        for s in alive:
            s.process.send(signal.SIGTERM)
        deadline = time.monotonic() + self.spec.drain_timeout_s + self.kill_grace_s
        while any(s.alive() for s in alive) and time.monotonic() < deadline and not self._force:
            time.sleep(0.05)
        for s in alive:
            if s.alive():
                self._log(f"{s.name} did not stop in time: SIGKILL")
                s.process.send(signal.SIGKILL)
        # Reaps every child, closes logs, then runs the server stops (Redis, then NATS).
        self.group.stop(timeout_s=max(self.kill_grace_s, 1.0))
        self.exit_codes = {s.name: s.returncode for s in self.services.values()}
        self.state = "stopped"
        if self._state_written:
            self.write_state()
        return self.exit_codes

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
