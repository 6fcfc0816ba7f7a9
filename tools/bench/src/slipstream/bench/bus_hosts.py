"""`slipstream bench bus --hosts N`: trajectories per second through a replicated JetStream cluster vs one node.

Both sides run on hosts made of network namespaces (`slipstream.stack.hosts`, root only), so the
replicated side pays for real network hops between its nodes:

- single: one nats-server on host 0, streams with 1 replica;
- replicated: a 3-node cluster on hosts 0-2 (`slipstream.stack.cluster`), streams with 3
  replicas, the client given every node's URL.

Each side moves the same trajectories through the bus library (`publish_async` + `flush`, then
the reward-model's durable: `fetch` + `ack`), in one run, one after the other. The figure is the
replicated rate over the single-node rate per phase; the issue's target is >= 0.5.

Beside each rate, the CPU it cost (from /proc: the client process and every nats-server), as
microseconds of CPU per trajectory and cores busy. The namespace hosts share this machine's cores,
so a cluster whose servers need more CPU per trajectory than the cores left can give is
CPU-bound here where three real hosts would not be; these columns show when that is the case.
"""

from __future__ import annotations

import asyncio
import gc
import os
import tempfile
import time
from pathlib import Path
from typing import Any

TARGET = 0.5
SUBJECT = "traj.raw.bench"
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(server_pids: list[int]) -> tuple[float, float]:
    """CPU seconds so far of this process (the client) and of the servers together."""
    t = os.times()
    servers = 0.0
    for pid in server_pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        servers += (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime
    return t.user + t.system, servers


async def _through(url: str, replicas: int, msgs: list[Any], server_pids: list[int]) -> dict[str, float]:
    """Publish then consume `msgs` through the library against `url`; seconds and CPU seconds per phase."""
    from slipstream.bus import BusConfig, BusError, connect_bus
    from slipstream.schemas import Trajectory

    bus = await connect_bus(BusConfig(url=url, ack_timeout_s=30.0, stream_replicas=replicas), name="bench-hosts")
    try:
        deadline = time.monotonic() + 30.0
        while True:  # a fresh cluster refuses R3 streams ("no suitable peers") until every node has met
            try:
                await bus.ensure_streams()
                break
            except BusError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        gc.collect()
        cpu0, t0 = _cpu_s(server_pids), time.perf_counter()
        for m in msgs:
            await bus.publish_async(SUBJECT, m)
        await bus.flush(timeout=120)
        publish_s = time.perf_counter() - t0
        cpu1 = _cpu_s(server_pids)
        consumer = await bus.consumer("reward-model", Trajectory)
        cpu2, got, t0 = _cpu_s(server_pids), 0, time.perf_counter()
        while got < len(msgs):
            batch = await consumer.fetch(timeout=10.0)
            if not batch:
                raise RuntimeError(f"consume stalled at {got}/{len(msgs)} against {url}")
            for d in batch:
                await d.ack()
            got += len(batch)
        consume_s = time.perf_counter() - t0
        cpu3 = _cpu_s(server_pids)
        await consumer.close()
        info = await bus.stream_info("TRAJ_RAW")
    finally:
        await bus.close()
    return {
        "publish_s": publish_s,
        "consume_s": consume_s,
        "copies": 1 + len(info["replicas"]),
        "publish_client_cpu_s": cpu1[0] - cpu0[0],
        "publish_servers_cpu_s": cpu1[1] - cpu0[1],
        "consume_client_cpu_s": cpu3[0] - cpu2[0],
        "consume_servers_cpu_s": cpu3[1] - cpu2[1],
    }


async def _measure(n_hosts: int, msgs: list[Any], body: float) -> dict[str, Any]:
    from slipstream.stack.cluster import start_nats_cluster
    from slipstream.stack.hosts import Hosts, unavailable

    why = unavailable()
    if why:
        raise SystemExit(f"bench bus --hosts: no network namespaces here ({why})")
    if n_hosts < 3:
        raise SystemExit(f"bench bus --hosts: a replicated cluster needs 3 hosts, got {n_hosts}")
    n = len(msgs)
    with tempfile.TemporaryDirectory(prefix="slipstream-bench-hosts-") as tmp, Hosts(n_hosts) as hosts:
        single = start_nats_cluster(hosts, Path(tmp) / "single", Path(tmp) / "logs-single", nodes=1)
        one = await _through(single.url, 1, msgs, [p.proc.pid for p in single.procs.values()])
        single.stop(0, kill=False)
        cluster = start_nats_cluster(hosts, Path(tmp) / "cluster", Path(tmp) / "logs-cluster", nodes=3)
        three = await _through(cluster.url, 3, msgs, [p.proc.pid for p in cluster.procs.values()])
    rates = {
        side: {p: n / r[f"{p}_s"] for p in ("publish", "consume")} | {"copies": r["copies"]}
        for side, r in (("single", one), ("replicated", three))
    }
    ratio = {p: rates["replicated"][p] / rates["single"][p] for p in ("publish", "consume")}
    cpu = {
        side: {
            p: {
                who: {
                    "us_per_trajectory": 1e6 * r[f"{p}_{who}_cpu_s"] / n,
                    "cores_busy": r[f"{p}_{who}_cpu_s"] / r[f"{p}_s"],
                }
                for who in ("client", "servers")
            }
            for p in ("publish", "consume")
        }
        for side, r in (("single", one), ("replicated", three))
    }
    return {
        "bench": "bus-hosts",
        "hosts": n_hosts,
        "messages": n,
        "body_bytes_mean": body,
        "trajectories_per_s": rates,
        "ratio": ratio,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "target": TARGET,
        "meets_target": all(r >= TARGET for r in ratio.values()),
    }


def table(res: dict[str, Any]) -> str:
    """The results as a few lines of text."""
    r = res["trajectories_per_s"]
    lines = [
        f"bus bench across {res['hosts']} hosts (network namespaces): {res['messages']} trajectories of "
        f"~{res['body_bytes_mean']:.0f} B, one run; ratio = replicated / single, target >= {res['target']}",
        f"{'phase':<9}{'single (1 copy) /s':>20}{'replicated (' + str(r['replicated']['copies']) + ' copies) /s':>26}"
        f"{'ratio':>8}",
    ]
    for p in ("publish", "consume"):
        lines.append(f"{p:<9}{r['single'][p]:>20,.0f}{r['replicated'][p]:>26,.0f}{res['ratio'][p]:>8.2f}")
    c = res["cpu"]
    lines.append(f"CPU per trajectory, µs (cores busy), client + nats-servers; this machine has {res['cores']} cores:")
    for p in ("publish", "consume"):
        cells = [
            f"{side} {c[side][p]['client']['us_per_trajectory']:.0f} ({c[side][p]['client']['cores_busy']:.2f}) + "
            f"{c[side][p]['servers']['us_per_trajectory']:.0f} ({c[side][p]['servers']['cores_busy']:.2f})"
            for side in ("single", "replicated")
        ]
        lines.append(f"{p:<9}" + ";  ".join(cells))
    lines.append("meets target" if res["meets_target"] else "BELOW TARGET")
    return "\n".join(lines)


def measure(n_hosts: int, msgs: list[Any], body_bytes: float) -> dict[str, Any]:
    """Run both sides with `msgs` (Trajectory structs of `body_bytes` each on average) and return the results."""
    return asyncio.run(_measure(n_hosts, msgs, body_bytes))
