"""`slipstream bench bus`: the bus library against raw nats-py on the same nats-server.

Both sides move the same number of trajectory-sized messages through a work-queue stream with
the same configuration (file storage, the TRAJ_RAW stream and reward-model consumer settings):

- library: `publish_async` of real `Trajectory` structs (encode, headers and size check
  included) then `flush`; then `consumer.fetch` + `ack` of each delivery (decode included);
- raw: `js.publish_async` of the same bytes, pre-encoded, with the same bound on bytes in flight
  and a timeout on completion; then a durable pull consumer's `fetch(batch)` + `ack()` each.

The target is library >= 80 % of raw on both phases. It starts its own nats-server in a
temporary directory and prints msgs/s, MB/s (10^6 bytes of message body) and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from array import array
from collections import deque
from pathlib import Path
from typing import Any

TARGET = 0.8
SUBJECT = "traj.raw.bench"
RAW_STREAM = "BENCH_RAW"
RAW_SUBJECT = "bench.raw.traj"
RAW_DURABLE = "bench-raw"
POOL = 64  # distinct encoded payloads the raw side cycles through
VOCAB = 151_936


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "bus",
        help="bus library vs raw nats-py: publish and consume throughput (starts its own nats-server)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", metavar="FILE", default="", help="write the results as JSON to FILE")
    p.add_argument("--messages", type=int, default=20_000, help="messages per phase (default 20000)")
    p.add_argument("--size", type=int, default=23_000, help="approximate encoded Trajectory size in bytes")
    p.add_argument("--reps", type=int, default=1, help="repetitions; the median is reported")
    p.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    run(args)
    return 0


def make_trajectory(i: int, size: int, rng: random.Random) -> Any:
    """A realistic Trajectory (packed token ids, logprobs, mask, 20 turns) of about `size` bytes."""
    from slipstream.schemas import PolicySegment, Trajectory, Turn, encode

    n_tokens = max(16, int(size * 0.7 / 8))  # 4 B id + 0.8 × (4 B logprob + 1 B mask) per token
    prompt_len = n_tokens // 5
    completion = n_tokens - prompt_len
    words = ["alpha", "beta", "gamma", "delta", "tool", "search", "result", "answer", "token", "policy"]
    per_turn = max(8, int(size * 0.2 / 20 / 6))
    turns = [
        Turn(
            role="policy" if t % 2 == 0 else "tool",
            start=prompt_len + t * completion // 20,
            end=prompt_len + (t + 1) * completion // 20,
            text=" ".join(rng.choice(words) for _ in range(per_turn)),
        )
        for t in range(20)
    ]
    traj = Trajectory(
        trajectory_id=f"bench-{i:08d}",
        task_id=f"task-{i // 8:07d}",
        env="bench",
        run_id="bench",
        group_index=i % 8,
        group_size=8,
        prompt_len=prompt_len,
        token_ids=array("i", (rng.randrange(VOCAB) for _ in range(n_tokens))).tobytes(),
        logprobs=array("f", (-5.0 * rng.random() for _ in range(completion))).tobytes(),
        loss_mask=bytes(1 for _ in range(completion)),
        segments=[PolicySegment(3, completion // 2), PolicySegment(4, completion - completion // 2)],
        turns=turns,
        finish_reason="stop",
        worker_id="bench-0",
        metadata={"source": "bench"},
    )
    pad = size - len(encode(traj))
    if pad > 0:
        traj.completion_text = "x" * pad
    return traj


def build_messages(n: int, size: int) -> tuple[list[Any], list[bytes]]:
    """`n` structs (a pool of distinct bodies, each with its own id) and the raw side's payloads."""
    import msgspec

    from slipstream.schemas import encode

    rng = random.Random(20261121)
    pool = [make_trajectory(i, size, rng) for i in range(POOL)]
    msgs = [msgspec.structs.replace(pool[i % POOL], trajectory_id=f"bench-{i:08d}") for i in range(n)]
    return msgs, [encode(m) for m in msgs[:POOL]]


async def _library_rep(url: str, msgs: list[Any]) -> dict[str, float]:
    from slipstream.bus import BusConfig, connect_bus
    from slipstream.schemas import Trajectory, encode

    n = len(msgs)
    body = sum(len(encode(m)) for m in msgs[:POOL]) / POOL * n
    bus = await connect_bus(BusConfig(url=url, ack_timeout_s=30.0), name="bench-library")
    try:
        await bus.ensure_streams()
        t0 = time.perf_counter()
        for m in msgs:
            await bus.publish_async(SUBJECT, m)
        await bus.flush(timeout=120)
        t_pub = time.perf_counter() - t0

        consumer = await bus.consumer("reward-model", Trajectory)
        got = 0
        t0 = time.perf_counter()
        while got < n:
            batch = await consumer.fetch(timeout=10.0)
            if not batch:
                raise RuntimeError(f"library consume stalled at {got}/{n}")
            for d in batch:
                await d.ack()
            got += len(batch)
        await bus.nc.flush()  # type: ignore[attr-defined]  # the acks are on the wire
        t_con = time.perf_counter() - t0
        await consumer.close()
        left = (await bus.stream_info("TRAJ_RAW"))["messages"]
        if left:
            raise RuntimeError(f"library side left {left} messages in TRAJ_RAW")
    finally:
        await bus.close()
    return {"publish_s": t_pub, "consume_s": t_con, "body_bytes": body}


async def _raw_rep(url: str, payloads: list[bytes], n: int) -> dict[str, float]:
    import nats
    from nats.js.api import StreamConfig

    from slipstream.bus import BusConfig
    from slipstream.bus.provisioning import consumer_config, stream_config
    from slipstream.schemas.subjects import stream

    cfg = BusConfig(url=url)
    spec = stream("TRAJ_RAW")
    sc: StreamConfig = stream_config(spec, [RAW_SUBJECT], cfg)
    sc.name = RAW_STREAM
    cc = consumer_config(spec.consumers[0])
    cc.name = cc.durable_name = RAW_DURABLE
    cc.filter_subject = RAW_SUBJECT
    timeout = 30.0
    nc = await nats.connect(url, name="bench-raw")
    try:
        js = nc.jetstream(publish_async_max_pending=cfg.max_inflight_msgs)
        await js.add_stream(sc)
        await js.add_consumer(RAW_STREAM, cc)
        body = sum(len(payloads[i % len(payloads)]) for i in range(n))

        pending: deque[tuple[asyncio.Future[Any], int]] = deque()
        inflight = 0
        t0 = time.perf_counter()
        for i in range(n):
            data = payloads[i % len(payloads)]
            while pending and inflight + len(data) > cfg.max_inflight_bytes:
                fut, size = pending.popleft()
                await asyncio.wait_for(fut, timeout)
                inflight -= size
            pending.append((await js.publish_async(RAW_SUBJECT, data), len(data)))
            inflight += len(data)
        await asyncio.wait_for(js.publish_async_completed(), timeout)
        t_pub = time.perf_counter() - t0
        for fut, _ in pending:
            fut.result()  # raise if any publish failed

        sub = await js.pull_subscribe_bind(durable=RAW_DURABLE, stream=RAW_STREAM)
        got = 0
        t0 = time.perf_counter()
        while got < n:
            msgs = await sub.fetch(cfg.fetch_batch, timeout=10.0)
            for m in msgs:
                await m.ack()
            got += len(msgs)
        await nc.flush()
        t_con = time.perf_counter() - t0
        await sub.unsubscribe()
        await js.delete_stream(RAW_STREAM)
    finally:
        await nc.close()
    return {"publish_s": t_pub, "consume_s": t_con, "body_bytes": body}


def _rates(runs: list[dict[str, float]], n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for phase in ("publish", "consume"):
        per = [n / r[f"{phase}_s"] for r in runs]
        mbs = [r["body_bytes"] / r[f"{phase}_s"] / 1e6 for r in runs]
        out[phase] = {
            "msgs_per_s": statistics.median(per),
            "mb_per_s": statistics.median(mbs),
            "runs_msgs_per_s": [round(x, 1) for x in per],
        }
    return out


async def _measure(n: int, size: int, reps: int) -> dict[str, Any]:
    from slipstream.schemas import encode
    from slipstream.stack import start_nats

    msgs, payloads = build_messages(n, size)
    lib_runs: list[dict[str, float]] = []
    raw_runs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="slipstream-bench-bus-") as tmp:
        server = start_nats(Path(tmp) / "nats", Path(tmp) / "logs")
        try:
            for _ in range(reps):
                lib_runs.append(await _library_rep(server.url, msgs))
                raw_runs.append(await _raw_rep(server.url, payloads, n))
        finally:
            server.stop()
    lib, raw = _rates(lib_runs, n), _rates(raw_runs, n)
    ratio = {p: lib[p]["msgs_per_s"] / raw[p]["msgs_per_s"] for p in ("publish", "consume")}
    return {
        "bench": "bus",
        "messages": n,
        "size_target": size,
        "body_bytes_mean": sum(len(encode(m)) for m in msgs[:POOL]) / POOL,
        "reps": reps,
        "library": lib,
        "raw": raw,
        "ratio": ratio,
        "target": TARGET,
        "meets_target": all(r >= TARGET for r in ratio.values()),
        "python": sys.version.split()[0],
    }


def _table(res: dict[str, Any]) -> str:
    lines = [
        f"bus bench: {res['messages']} messages of ~{res['body_bytes_mean']:.0f} B, "
        f"{res['reps']} rep(s), median; target library >= {res['target']:.0%} of raw",
        f"{'phase':<9}{'library msg/s':>15}{'MB/s':>9}{'raw msg/s':>13}{'MB/s':>9}{'ratio':>8}",
    ]
    for phase in ("publish", "consume"):
        lib, raw = res["library"][phase], res["raw"][phase]
        lines.append(
            f"{phase:<9}{lib['msgs_per_s']:>15,.0f}{lib['mb_per_s']:>9.0f}"
            f"{raw['msgs_per_s']:>13,.0f}{raw['mb_per_s']:>9.0f}{res['ratio'][phase]:>8.2f}"
        )
    lines.append("meets target" if res["meets_target"] else "BELOW TARGET")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure, print the table, write the JSON (when --json is given); return the results."""
    if args.messages < 1 or args.size < 256 or args.reps < 1:
        raise SystemExit("bench bus: --messages >= 1, --size >= 256 and --reps >= 1 are required")
    res = asyncio.run(_measure(args.messages, args.size, args.reps))
    print(_table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.json}")
    return res


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="bench_bus")
    register(parser.add_subparsers(dest="bench", required=True))
    run(parser.parse_args(["bus", *sys.argv[1:]]))
