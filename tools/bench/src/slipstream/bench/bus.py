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
import gc
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
    p.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="N >= 3: instead, a 3-node replicated JetStream cluster vs one node, on N network-namespace hosts "
        "(root; bus_hosts.py)",
    )
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


class _Timer:
    """Wall and client-CPU seconds of one phase."""

    def __enter__(self) -> _Timer:
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall0
        self.cpu = time.process_time() - self.cpu0


class _LibrarySide:
    """The bus library: Trajectory structs in, decoded deliveries out."""

    def __init__(self, url: str, msgs: list[Any]) -> None:
        self.url, self.msgs = url, msgs

    async def open(self) -> None:
        from slipstream.bus import BusConfig, connect_bus

        self.bus = await connect_bus(BusConfig(url=self.url, ack_timeout_s=30.0), name="bench-library")
        await self.bus.ensure_streams()

    async def publish(self) -> None:
        bus = self.bus
        for m in self.msgs:
            await bus.publish_async(SUBJECT, m)
        await bus.flush(timeout=120)

    async def consume(self) -> None:
        from slipstream.schemas import Trajectory

        n = len(self.msgs)
        consumer = await self.bus.consumer("reward-model", Trajectory)
        got = 0
        while got < n:
            batch = await consumer.fetch(timeout=10.0)
            if not batch:
                raise RuntimeError(f"library consume stalled at {got}/{n}")
            for d in batch:
                await d.ack()
            got += len(batch)
        await self.bus.nc.flush()  # type: ignore[attr-defined]  # the acks are on the wire
        await consumer.close()

    async def close(self) -> None:
        left = -1
        for _ in range(50):  # the server applies acks a moment after it read them
            left = (await self.bus.stream_info("TRAJ_RAW"))["messages"]
            if left == 0:
                break
            await asyncio.sleep(0.05)
        await self.bus.close()
        if left:
            raise RuntimeError(f"library side left {left} messages in TRAJ_RAW")


class _RawSide:
    """nats-py alone: the same bytes, pre-encoded, through a stream configured the same way."""

    def __init__(self, url: str, payloads: list[bytes], n: int) -> None:
        self.url, self.payloads, self.n = url, payloads, n

    async def open(self) -> None:
        import nats

        from slipstream.bus import BusConfig
        from slipstream.bus.provisioning import consumer_config, stream_config
        from slipstream.schemas.subjects import stream

        self.cfg = BusConfig(url=self.url)
        spec = stream("TRAJ_RAW")
        sc = stream_config(spec, [RAW_SUBJECT], self.cfg)
        sc.name = RAW_STREAM
        cc = consumer_config(spec.consumers[0])
        cc.name = cc.durable_name = RAW_DURABLE
        cc.filter_subject = RAW_SUBJECT
        self.nc = await nats.connect(self.url, name="bench-raw")
        self.js = self.nc.jetstream(publish_async_max_pending=self.cfg.max_inflight_msgs)
        await self.js.add_stream(sc)
        await self.js.add_consumer(RAW_STREAM, cc)

    async def publish(self) -> None:
        js, payloads, limit, timeout = self.js, self.payloads, self.cfg.max_inflight_bytes, 30.0
        pending: deque[tuple[asyncio.Future[Any], int]] = deque()
        inflight = 0
        for i in range(self.n):
            data = payloads[i % len(payloads)]
            if pending and inflight + len(data) > limit:
                # Full: wait for the oldest acks down to half the bound (hysteresis: one wait per
                # message would flush the socket once per message and halve the rate).
                while pending and inflight > limit // 2:
                    fut, size = pending.popleft()
                    await asyncio.wait_for(fut, timeout)
                    inflight -= size
            pending.append((await js.publish_async(RAW_SUBJECT, data), len(data)))
            inflight += len(data)
        await asyncio.wait_for(js.publish_async_completed(), timeout)
        for fut, _ in pending:
            fut.result()  # raise if any publish failed

    async def consume(self) -> None:
        sub = await self.js.pull_subscribe_bind(durable=RAW_DURABLE, stream=RAW_STREAM)
        got = 0
        while got < self.n:
            msgs = await sub.fetch(self.cfg.fetch_batch, timeout=10.0)
            for m in msgs:
                await m.ack()
            got += len(msgs)
        await self.nc.flush()
        await sub.unsubscribe()

    async def close(self) -> None:
        await self.js.delete_stream(RAW_STREAM)
        await self.nc.close()


async def _rep(url: str, msgs: list[Any], payloads: list[bytes], raw_first: bool) -> dict[str, dict[str, float]]:
    """One repetition; publish phases run back to back, then consume phases (order alternates)."""
    sides: dict[str, Any] = {"library": _LibrarySide(url, msgs), "raw": _RawSide(url, payloads, len(msgs))}
    order = ["raw", "library"] if raw_first else ["library", "raw"]
    out: dict[str, dict[str, float]] = {k: {} for k in sides}
    for name in order:
        await sides[name].open()
    try:
        for phase in ("publish", "consume"):
            for name in order:
                gc.collect()
                with _Timer() as t:
                    await getattr(sides[name], phase)()
                out[name][f"{phase}_s"], out[name][f"{phase}_cpu_s"] = t.wall, t.cpu
    finally:
        for name in order:
            await sides[name].close()
    return out


def _summary(runs: list[dict[str, float]], n: int, body: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for phase in ("publish", "consume"):
        per = [n / r[f"{phase}_s"] for r in runs]
        out[phase] = {
            "msgs_per_s": statistics.median(per),
            "mb_per_s": statistics.median(per) * body / 1e6,
            "cpu_us_per_msg": statistics.median(r[f"{phase}_cpu_s"] / n * 1e6 for r in runs),
            "runs_msgs_per_s": [round(x, 1) for x in per],
        }
    return out


async def _measure(n: int, size: int, reps: int) -> dict[str, Any]:
    from slipstream.stack import start_nats

    msgs, payloads = build_messages(n, size)
    body = sum(len(p) for p in payloads) / len(payloads)
    # The message pool is scaffolding: keep it out of the collector's way for both sides alike.
    gc.collect()
    gc.freeze()
    runs: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="slipstream-bench-bus-") as tmp:
        server = start_nats(Path(tmp) / "nats", Path(tmp) / "logs")
        try:
            for rep in range(reps):
                runs.append(await _rep(server.url, msgs, payloads, raw_first=rep % 2 == 1))
        finally:
            server.stop()
            gc.unfreeze()
    lib = _summary([r["library"] for r in runs], n, body)
    raw = _summary([r["raw"] for r in runs], n, body)
    # Ratio per repetition (the two sides ran side by side), then the median: robust to a noisy host.
    ratio = {
        p: statistics.median(r["raw"][f"{p}_s"] / r["library"][f"{p}_s"] for r in runs) for p in ("publish", "consume")
    }
    return {
        "bench": "bus",
        "messages": n,
        "size_target": size,
        "body_bytes_mean": body,
        "reps": reps,
        "library": lib,
        "raw": raw,
        "ratio": ratio,
        "target": TARGET,
        "meets_target": all(r >= TARGET for r in ratio.values()),
        "python": sys.version.split()[0],
    }


CODEC_TARGET_US = 20.0


def codec_cost(n: int = 20_000) -> dict[str, Any]:
    """Encode + decode of a 2,000-token, 20-turn trajectory (msgpack, packed arrays): µs per round trip."""
    import time

    from slipstream.schemas import PolicySegment, Trajectory, Turn, decode, encode, pack_floats, pack_ids, pack_mask

    rng = random.Random(0)
    tokens = 2000
    traj = Trajectory(
        trajectory_id="t" * 32,
        task_id="task",
        env="reverse",
        prompt_len=200,
        token_ids=pack_ids(rng.randrange(151_936) for _ in range(tokens)),
        logprobs=pack_floats(-rng.random() for _ in range(tokens - 200)),
        loss_mask=pack_mask([1] * (tokens - 200)),
        segments=[PolicySegment(3, 900), PolicySegment(4, 900)],
        turns=[Turn(role="policy", start=i * 100, end=i * 100 + 100, text="word " * 40) for i in range(20)],
    )
    wire = encode(traj)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            decode(encode(traj), Trajectory)
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return {"tokens": tokens, "wire_bytes": len(wire), "encode_decode_us": best, "target_us": CODEC_TARGET_US}


def _table(res: dict[str, Any]) -> str:
    lines = [
        f"bus bench: {res['messages']} messages of ~{res['body_bytes_mean']:.0f} B, "
        f"{res['reps']} rep(s), medians; ratio = library/raw per rep; target >= {res['target']:.0%}",
        f"{'phase':<9}{'library msg/s':>15}{'MB/s':>7}{'cpu µs':>8}{'raw msg/s':>12}{'MB/s':>7}{'cpu µs':>8}"
        f"{'ratio':>7}",
    ]
    for phase in ("publish", "consume"):
        lib, raw = res["library"][phase], res["raw"][phase]
        lines.append(
            f"{phase:<9}{lib['msgs_per_s']:>15,.0f}{lib['mb_per_s']:>7.0f}{lib['cpu_us_per_msg']:>8.1f}"
            f"{raw['msgs_per_s']:>12,.0f}{raw['mb_per_s']:>7.0f}{raw['cpu_us_per_msg']:>8.1f}"
            f"{res['ratio'][phase]:>7.2f}"
        )
    lines.append("meets target" if res["meets_target"] else "BELOW TARGET")
    c = res.get("codec")
    if c:
        ok = "meets target" if c["encode_decode_us"] < c["target_us"] else "BELOW TARGET"
        lines.append(
            f"codec: encode + decode of a {c['tokens']}-token trajectory ({c['wire_bytes']:,} B): "
            f"{c['encode_decode_us']:.1f} µs (target < {c['target_us']:.0f} µs, {ok})"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure, print the table, write the JSON (when --json is given); return the results."""
    if args.messages < 1 or args.size < 256 or args.reps < 1:
        raise SystemExit("bench bus: --messages >= 1, --size >= 256 and --reps >= 1 are required")
    if args.hosts:
        from slipstream.bench.bus_hosts import measure, table

        msgs, payloads = build_messages(args.messages, args.size)
        res = measure(args.hosts, msgs, sum(len(p) for p in payloads) / len(payloads))
        print(table(res))
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
            print(f"wrote {args.json}")
        return res
    res = asyncio.run(_measure(args.messages, args.size, args.reps))
    res["codec"] = codec_cost()
    print(_table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.json}")
    return res


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="bench_bus")
    register(parser.add_subparsers(dest="bench", required=True))
    run(parser.parse_args(["bus", *sys.argv[1:]]))
