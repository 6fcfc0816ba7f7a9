"""One look at a running stack from its stack.json: servers, services' readiness, streams, versions, the learner.

`load_stack` reads a run's stack.json as a `StackFile` and checks that it names the servers the
commands need (shared with `slipstream eval/promote/rollback`);
`collect` gathers what `slipstream status` shows (NATS and Redis reachability, each service's
/readyz, every stream's messages and backlogs, dead letters, the announced and promoted versions,
the last eval result and learner step); `render` draws it as rich tables; `exit_code` is 0 when
the servers answer and every service is ready.
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream.stack.probe import HOST, probe_tcp, url_endpoint
from slipstream.stack.spec import HOME
from slipstream.stack.stackfile import FILE as STACK_FILE
from slipstream.stack.stackfile import ServerEntry, ServiceEntry, StackFile, StackFileError, read_stack_file

if TYPE_CHECKING:
    from slipstream.bus import BusConfig

DEFAULT_RUN_DIR = HOME / "current"
_READ_LAST_S = 1.0


class StatusError(Exception):
    """No usable stack.json (no run, or not a stack directory)."""


def load_stack(run_dir: Path) -> StackFile:
    """The run's stack.json, checked for what the commands need; StatusError says what is missing."""
    path = run_dir / STACK_FILE
    if not path.exists():
        hint = " (start one with `slipstream up`)" if run_dir == DEFAULT_RUN_DIR else ""
        raise StatusError(f"no {STACK_FILE} in {run_dir}: not a running stack{hint}")
    try:
        info = read_stack_file(run_dir)
    except StackFileError as exc:
        raise StatusError(str(exc)) from None
    for server in ("nats", "redis"):
        if not info.server_url(server):
            raise StatusError(f"{path} names no {server} server URL")
    return info


# ---- collecting ---------------------------------------------------------------------------------


async def collect(info: StackFile, *, timeout_s: float = 3.0) -> dict[str, Any]:
    from slipstream.stack.credentials import bus_config_for, redis_url_for

    """Everything `status` shows, probed now. Unreachable parts are reported in `errors`, never raised."""
    status: dict[str, Any] = {
        "run_id": info.run_id,
        "run_dir": info.run_dir,
        "state": info.state,
        "servers": [server_row(name, s) for name, s in info.servers.items()],
        "services": [service_row(name, s, *read_json(s.port, "/readyz")) for name, s in info.services.items()],
        "streams": [],
        "dlq": {},
        "versions": {},
        "learner": None,
        "errors": [],
    }
    servers = {row["name"]: row for row in status["servers"]}
    if servers["nats"]["up"]:
        await _from_bus(status, bus_config_for(info, connect_budget_s=timeout_s))
    else:
        status["errors"].append(f"nats at {info.server_url('nats')} is not reachable")
    if servers["redis"]["up"]:
        await _from_redis(status, redis_url_for(info), timeout_s)
    else:
        status["errors"].append(f"redis at {info.server_url('redis')} is not reachable")
    verified = [row["verified_version"] for row in status["services"] if "verified_version" in row]
    if verified:
        # The workers' verified view beats the last message on the subject, which anyone can publish.
        last = status["versions"].get("latest")
        status["versions"]["latest"] = max(verified)
        if last is not None and last != max(verified):
            status["versions"]["last_announce_message"] = last
    latest = status["versions"].get("latest")
    for row in status["services"]:
        v = row.get("policy_version")
        row["versions_behind"] = latest - v if isinstance(v, int) and isinstance(latest, int) else None
    return status


def server_row(name: str, server: ServerEntry) -> dict[str, Any]:
    url = server.url
    return {"name": name, "url": url, "up": probe_tcp(*url_endpoint(url, 4222 if name == "nats" else 6379))}


def read_json(
    port: int, path: str, timeout_s: float = 1.0, host: str = HOST
) -> tuple[int | None, dict[str, Any] | None]:
    """(HTTP status, JSON body) of GET path on `host` (loopback by default); (None, None) when nothing answers."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        raw = resp.read()
    except (OSError, http.client.HTTPException):
        return None, None
    finally:
        conn.close()
    try:
        body = json.loads(raw)
    except ValueError:
        return resp.status, None
    return resp.status, body if isinstance(body, dict) else None


def service_row(name: str, svc: ServiceEntry, code: int | None, body: dict[str, Any] | None) -> dict[str, Any]:
    """One service's line: health from its /readyz answer, and the version it works with."""
    if code is None:
        health = "no answer"
    elif code == 200:
        health = "ready"
    else:
        health = f"not ready ({(body or {}).get('state', code)})"
    st = (body or {}).get("status") or {}
    progress = st.get("progress") or {}
    if code is not None and code != 200 and progress.get("stalled"):
        health = f"not ready (stalled: {progress.get('reason', '')})"
    weights = st.get("weights") or {}
    row: dict[str, Any] = {"name": name, "pid": svc.pid, "url": svc.url, "health": health}
    # Written by the supervisor into stack.json at every restart (absent in an older stack.json: 0).
    row["restarts"] = svc.restarts
    version = st.get("policy_version")
    row["policy_version"] = version if isinstance(version, int) else None
    if weights.get("follow"):
        row["follow"] = weights["follow"]
    announced, announces = weights.get("announced_version"), weights.get("announces")
    # Only versions its verifier accepted: a forged announce far ahead never shows up here.
    verifying = isinstance(announces, dict) and announces.get("signatures") in ("required", "off")
    if verifying and isinstance(announced, int) and announced >= 0:
        row["verified_version"] = announced
    control = st.get("control")
    if isinstance(control, dict) and control.get("redis"):
        row["redis"] = control["redis"]
    # Weight announces this service refused (forged, unsigned, unfetchable, spoofed fence), by reason.
    announces = st.get("announces") or weights.get("announces") or {}
    refused = announces.get("refused") if isinstance(announces, dict) else None
    if isinstance(refused, dict) and refused:
        row["refused_announces"] = {str(k): int(v) for k, v in refused.items()}
    return row


def stream_row(info: dict[str, Any], durables: frozenset[str] = frozenset()) -> dict[str, Any]:
    """A stream's messages and, per durable, pending (not yet delivered) and ack pending (unacked).

    Consumers not in `durables` are the ephemeral readers of fan-out subjects (weight followers,
    `slipstream top`): counted as `readers`, not listed.
    """
    consumers = info.get("consumers") or {}
    return {
        "name": info["name"],
        "messages": int(info.get("messages", 0)),
        "consumers": {
            name: {"pending": int(c.get("num_pending", 0)), "ack_pending": int(c.get("num_ack_pending", 0))}
            for name, c in sorted(consumers.items())
            if name in durables
        },
        "readers": sum(1 for name in consumers if name not in durables),
    }


def dlq_counts(subject_counts: dict[str, int], streams: list[str]) -> dict[str, int]:
    """Dead letters per source stream, from the DLQ stream's per-subject counts (`dlq.<STREAM>`)."""
    return {s: int(subject_counts.get(f"dlq.{s}", 0)) for s in streams if s != "DLQ"}


async def _from_bus(status: dict[str, Any], cfg: BusConfig) -> None:
    from slipstream.bus import BusError, connect_bus
    from slipstream.schemas import LearnerStep, WeightAnnounce, WeightsPromoted
    from slipstream.schemas.subjects import LEARNER_STEP, STREAMS, WEIGHTS_ANNOUNCE, WEIGHTS_PROMOTED

    try:
        bus = await connect_bus(cfg, name="slipstream-status")
    except BusError as exc:
        status["errors"].append(f"nats: {exc}")
        return
    try:
        names = [s.name for s in STREAMS]
        for spec in STREAMS:
            try:
                info = await bus.stream_info(spec.name)
                status["streams"].append(stream_row(info, frozenset(c.durable for c in spec.consumers)))
            except BusError as exc:
                status["errors"].append(str(exc))
        status["dlq"] = dlq_counts(await _dlq_subjects(bus, names), names)
        announce = await read_last(bus, WEIGHTS_ANNOUNCE, WeightAnnounce)
        if announce is not None:
            status["versions"]["latest"] = announce.policy_version
            status["versions"]["latest_run_id"] = announce.run_id
        promoted = await read_last(bus, WEIGHTS_PROMOTED, WeightsPromoted)
        if promoted is not None:
            status["versions"]["last_promoted_message"] = {
                "policy_version": promoted.policy_version,
                "previous_version": promoted.previous_version,
                "reason": promoted.reason,
                "run_id": promoted.run_id,
            }
        step = await read_last(bus, LEARNER_STEP, LearnerStep)
        if step is not None:
            status["learner"] = {
                "step": step.step,
                "policy_version": step.policy_version,
                "run_id": step.run_id,
                "reward_mean": step.reward_mean,
                "accuracy": step.accuracy,
                "staleness": dict(sorted(step.staleness.items(), key=lambda kv: _as_int(kv[0]))),
                "dropped": dict(step.dropped),
                "episodes": {
                    "trained": step.n_trajectories,
                    "samples": step.n_samples,
                    "turns_per_episode": step.turns_per_episode,
                    "tool_calls_per_turn": step.tool_calls_per_turn,
                    "invalid_call_rate": step.invalid_call_rate,
                    "samples_per_episode": step.samples_per_episode,
                },
            }
    finally:
        await bus.close()


async def _dlq_subjects(bus: Any, streams: list[str]) -> dict[str, int]:
    """Per-subject message counts of the DLQ stream (one request on NATS; reading letters otherwise)."""
    js = getattr(bus, "js", None)
    if js is not None:
        import nats.js.errors

        try:
            info = await js.stream_info("DLQ", subjects_filter="dlq.>")
        except nats.js.errors.NotFoundError:
            return {}
        return {k: int(v) for k, v in (info.state.subjects or {}).items()}
    return {f"dlq.{s}": len(await bus.dead_letters(s, limit=100_000)) for s in streams if s != "DLQ"}


async def read_last(bus: Any, subject: str, cls: type[Any]) -> Any:
    """The newest message on a fan-out subject, or None when there is none (within a second)."""
    import asyncio
    import contextlib

    reader = bus.subscribe(subject, cls, deliver="last")
    try:
        return (await asyncio.wait_for(anext(reader), _READ_LAST_S)).msg
    except (TimeoutError, StopAsyncIteration):
        return None
    finally:
        with contextlib.suppress(Exception):  # closing a reader that never opened may complain
            await reader.close()


async def _from_redis(status: dict[str, Any], url: str, timeout_s: float) -> None:
    from slipstream.control import ControlUnavailable, connect_control

    try:
        control = await connect_control(url, status["run_id"], timeout_s=timeout_s)
    except ControlUnavailable as exc:
        status["errors"].append(str(exc))
        return
    try:
        evals = control.evals
        versions = status["versions"]
        versions["promoted"] = await evals.promoted()
        versions["promotion_stack"] = await evals.promotion_stack()
        last = await evals.history(limit=1)
        if last:
            r = last[-1]
            versions["last_eval"] = {
                "policy_version": r.policy_version,
                "suite": r.suite,
                "score": r.score,
                "ci": [r.ci_low, r.ci_high],
                "baseline_version": r.baseline_version,
                "decision": r.decision,
                "reason": r.reason,
            }
    except ControlUnavailable as exc:
        status["errors"].append(str(exc))
    finally:
        await control.close()


# ---- showing --------------------------------------------------------------------------------------


def exit_code(status: dict[str, Any]) -> int:
    servers_up = all(s["up"] for s in status["servers"])
    services_ready = all(s["health"] == "ready" for s in status["services"])
    return 0 if servers_up and services_ready and not status["errors"] else 1


def render(status: dict[str, Any]) -> list[Any]:
    """Rich renderables: a header, then services, streams and versions tables."""
    from rich.table import Table

    out: list[Any] = [f"run [bold]{status['run_id']}[/bold] ({status['state']}) in {status['run_dir']}"]
    svc = Table(title="processes", title_justify="left")
    for col in ("name", "pid", "port", "health", "restarts", "version", "behind", "refused announces"):
        svc.add_column(col, no_wrap=col not in ("health", "refused announces"))
    for s in status["servers"]:
        health = "up" if s["up"] else "unreachable"
        svc.add_row(s["name"], "-", _port(s["url"]), _colour(health), "", "", "", "")
    for s in status["services"]:
        version = "" if s.get("policy_version") is None else f"v{s['policy_version']}"
        if s.get("follow") == "promoted":
            version += " (promoted)"
        behind = "" if s.get("versions_behind") is None else str(s["versions_behind"])
        health = s["health"] + (f", redis {s['redis']}" if s.get("redis") == "degraded" else "")
        refused = ", ".join(f"{k} {v}" for k, v in sorted((s.get("refused_announces") or {}).items()))
        restarts = s.get("restarts") or 0
        svc.add_row(
            s["name"],
            str(s.get("pid") or "-"),
            _port(s["url"]),
            _colour(health),
            f"[yellow]{restarts}[/yellow]" if restarts else "0",
            version,
            behind,
            refused,
        )
    out.append(svc)

    streams = Table(title="streams (pending: not yet delivered; unacked: delivered, not acked)", title_justify="left")
    for col in ("stream", "msgs", "consumer", "pending", "unacked", "dlq"):
        streams.add_column(col, no_wrap=True, justify="left" if col in ("stream", "consumer") else "right")
    for st in status["streams"]:
        consumers = list(st["consumers"].items()) or [("-", None)]
        dead = status["dlq"].get(st["name"])
        for i, (name, c) in enumerate(consumers):
            streams.add_row(
                st["name"] if i == 0 else "",
                str(st["messages"]) if i == 0 else "",
                name,
                "" if c is None else str(c["pending"]),
                "" if c is None else str(c["ack_pending"]),
                ("" if dead is None else (f"[red]{dead}[/red]" if dead else "0")) if i == 0 else "",
            )
    out.append(streams)

    out.append(_versions_table(status))
    for err in status["errors"]:
        out.append(f"[red]{err}[/red]")
    return out


def _versions_table(status: dict[str, Any]) -> Any:
    from rich.table import Table

    v = status["versions"]
    t = Table(title="versions", title_justify="left", show_header=False)
    t.add_column("what", no_wrap=True)
    t.add_column("value")
    t.add_row("latest announced", _v(v.get("latest")))
    promoted = _v(v.get("promoted"))
    if v.get("promotion_stack"):
        promoted += f"  (stack {' -> '.join(f'v{x}' for x in v['promotion_stack'])})"
    elif v.get("promoted") is None and v.get("last_promoted_message"):
        promoted = _v(v["last_promoted_message"]["policy_version"]) + " (last weights.promoted; Redis has none)"
    t.add_row("promoted", promoted)
    ev = v.get("last_eval")
    if ev:
        t.add_row(
            "last eval",
            f"v{ev['policy_version']} {ev['decision']}: score {ev['score']:.3f} "
            f"(CI {ev['ci'][0]:.3f}..{ev['ci'][1]:.3f}) - {ev['reason']}",
        )
    learner = status.get("learner")
    if learner:
        hist = ", ".join(f"{k}:{n}" for k, n in learner["staleness"].items()) or "-"
        t.add_row(
            "learner", f"step {learner['step']} -> v{learner['policy_version']}, reward {learner['reward_mean']:.3f}"
        )
        t.add_row("staleness", f"versions behind: episodes  {hist}")
        ep = learner.get("episodes")
        if ep:
            t.add_row("episodes", episode_line(ep))
        if learner["dropped"]:
            t.add_row("dropped", ", ".join(f"{k}: {n}" for k, n in sorted(learner["dropped"].items())))
    return t


def episode_line(ep: dict[str, Any]) -> str:
    """One line of a step's episode shape: turns, tool calls, invalid calls, samples."""
    return (
        f"{ep.get('trained', 0)} trained ({ep.get('samples', 0)} samples): "
        f"{ep.get('turns_per_episode', 0.0):.2f} turns/episode, {ep.get('tool_calls_per_turn', 0.0):.2f} "
        f"tool calls/turn, invalid-call rate {ep.get('invalid_call_rate', 0.0):.3f}, "
        f"{ep.get('samples_per_episode', 0.0):.2f} samples/episode"
    )


def _port(url: str) -> str:
    return url.rsplit(":", 1)[-1].split("/", 1)[0] if url else "-"


def _as_int(text: str) -> int:
    return int(text) if text.lstrip("-").isdigit() else 1 << 30


def _v(version: Any) -> str:
    return "-" if version is None else f"v{version}"


def _colour(health: str) -> str:
    if health in ("ready", "up"):
        return f"[green]{health}[/green]"
    return f"[red]{health}[/red]" if health.startswith(("no answer", "unreachable")) else f"[yellow]{health}[/yellow]"
