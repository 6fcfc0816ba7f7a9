"""`slipstream bench weights`: the weight-delta codec on a 25M-parameter model after real AdamW steps.

The learner side is the engine's "25m" preset with fp32 master weights and torch.optim.AdamW
(betas 0.9/0.95, weight decay 0.01) on random tokens: a warm-up at lr 1e-4, then, from that
same state, a few steps at each learning rate asked for. Every step publishes the bf16 copy as a
delta against the previous one (`slipstream.weights.publish_version`, local object store) and a
rollout worker in the same process takes it up the way a real one does: resolve the chain,
fetch and verify every shard, decode onto the version it holds, `TorchEngine.apply_weights`
while the engine is generating. Per step it reports

- delta fraction: stored bytes / raw bf16 bytes (and the ratio, its inverse);
- encode and decode MB/s (raw bf16 MB per second) of the library, next to the ceiling of the
  method measured in the same run on the same bytes: plain zstandard, the XOR'd model cut in
  one frame per thread, compressed and decompressed on that many threads. Decode writes into
  memory already touched, as the rollout worker does (it decodes each version into the memory
  of the version it held before last); decode into fresh memory, which the kernel must fault
  in and zero first, is shown next to it, again for both;
- in-flight pause: the engine's copy of the new weights between two decode steps;
- time-to-policy: from the end of the optimizer step (bf16 copy, encode, store, announce,
  fetch, verify, decode, apply) to the first token sampled under the new version.

Throughput reps run library and ceiling back to back so both see the same machine load (the
engine is paused meanwhile): MB/s are medians over reps, and a share of the ceiling is the median
over reps of that rep's ceiling time / library time; figures for a learning rate are medians
over its steps. Targets (2-core reference machine): delta <= 1/9 of raw at lr 1e-5 and
<= 1/40 at 1e-6, encode >= 800 MB/s and decode >= 1400 MB/s and >= 90 % of the ceiling,
pause < 50 ms, time-to-policy < 2 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MB = 1e6
FRACTION_TARGETS = {1e-5: 1 / 9, 1e-6: 1 / 40}
ENCODE_MB_S, DECODE_MB_S, CEILING_SHARE = 800.0, 1400.0, 0.9
PAUSE_MS, TIME_TO_POLICY_S = 50.0, 2.0


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "weights",
        help="weight-delta codec on a 25M model after AdamW steps: size, MB/s, pause, time-to-policy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", metavar="FILE", default="", help="write the results as JSON to FILE")
    p.add_argument("--preset", default="25m", help="engine model preset (default 25m)")
    p.add_argument("--lrs", default="1e-5,1e-6", help="learning rates, comma-separated (default 1e-5,1e-6)")
    p.add_argument("--warmup", type=int, default=10, help="AdamW steps at lr 1e-4 first (default 10)")
    p.add_argument("--steps", type=int, default=3, help="steps per learning rate (default 3)")
    p.add_argument("--reps", type=int, default=9, help="throughput repetitions per step; medians (default 9)")
    p.add_argument("--threads", type=int, default=2, help="codec threads, and frames of the ceiling (default 2)")
    p.add_argument("--level", type=int, default=1, help="zstd level (default 1)")
    p.add_argument("--batch", type=int, default=2, help="training batch size (default 2)")
    p.add_argument("--seq", type=int, default=64, help="training sequence length (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    run(args)
    return 0


def _log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


class _Generator:
    """A TorchEngine kept generating on its own thread; records when each policy version first samples."""

    def __init__(self, engine: Any, prompt: list[int]) -> None:
        from slipstream.engine import GenerationRequest, SamplingParams

        self.engine = engine
        self._request = lambda i: GenerationRequest(
            request_id=f"bench-{i}", prompt_ids=prompt, params=SamplingParams(max_tokens=256, ignore_eos=True)
        )
        self._n = 0
        self.first_sample: dict[int, float] = {}
        self.pauses_ms: dict[int, float] = {}
        self._run = threading.Event()
        self._idle = threading.Event()
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._guarded, name="bench-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self.resume()

    def pause(self) -> None:
        self._idle.clear()
        self._run.clear()
        if not self._idle.wait(timeout=30):
            raise TimeoutError("the engine thread did not pause within 30s")
        if self.error is not None:
            raise RuntimeError("the engine thread failed") from self.error

    def resume(self) -> None:
        self._run.set()

    def stop(self) -> None:
        self._stop = True
        self._run.set()
        self._thread.join(timeout=30)

    def _guarded(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # reported by wait_for/pause in the main thread
            self.error = exc
            self._idle.set()

    def _loop(self) -> None:
        while not self._stop:
            if not self._run.is_set():
                self._idle.set()
                self._run.wait(timeout=0.1)
                continue
            stats = self.engine.stats()
            for _ in range(self.engine.max_batch - int(stats["running"] + stats["waiting"])):
                self.engine.submit(self._request(self._n))
                self._n += 1
            updates = stats["weight_updates"]
            self.engine.step()  # a version applied in this step is what it sampled with
            after = self.engine.stats()
            if after["weight_updates"] != updates:
                version = self.engine.policy_version
                self.first_sample[version] = time.perf_counter()
                self.pauses_ms[version] = after["last_weight_apply_ms"]

    def wait_for(self, version: int, timeout: float = 30.0) -> float:
        deadline = time.monotonic() + timeout
        while version not in self.first_sample:
            if self.error is not None:
                raise RuntimeError("the engine thread failed") from self.error
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine did not sample under version {version} within {timeout:.0f}s")
            time.sleep(0.0005)
        return self.first_sample[version]


def _ceiling(
    pool: ThreadPoolExecutor, old: Any, new: Any, threads: int, level: int
) -> tuple[Callable[[], Any], Callable[..., Any], int]:
    """Plain zstandard on the flattened model: XOR + compress / decompress + XOR, one frame per thread."""
    import numpy as np
    import zstandard

    n = old.size
    cuts = [(n * i // threads, n * (i + 1) // threads) for i in range(threads)]
    comps = [zstandard.ZstdCompressor(level=level) for _ in range(threads)]

    def encode() -> list[bytes]:
        return list(
            pool.map(
                lambda i: comps[i].compress(np.bitwise_xor(old[slice(*cuts[i])], new[slice(*cuts[i])])), range(threads)
            )
        )

    blobs = encode()

    def decode(out: Any = None) -> Any:
        out = np.empty_like(old) if out is None else out

        def one(i: int) -> None:
            a, b = cuts[i]
            x = np.frombuffer(zstandard.ZstdDecompressor().decompress(blobs[i]), old.dtype)
            np.bitwise_xor(old[a:b], x, out=out[a:b])

        list(pool.map(one, range(threads)))
        return out

    if not np.array_equal(decode(), new):
        raise AssertionError("ceiling codec did not round-trip")
    return encode, decode, sum(len(b) for b in blobs)


def _flat_bits(tensors: Mapping[str, Any]) -> Any:
    import torch

    return torch.cat([t.reshape(-1) for t in tensors.values()]).view(torch.int16).numpy().view("uint16")


def _same_bits(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


def _interleaved(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[float]]:
    """Seconds of each rep of each function; a rep runs them all back to back, in turn forwards and backwards."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(reps):
        order = list(fns) if r % 2 == 0 else list(reversed(fns))
        for k in order:
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    return times


def _share(lib: list[float], ceiling: list[float]) -> float:
    """Library speed as a fraction of the ceiling's: the median over reps of ceiling time / library time.

    Each rep times both back to back, so a rep's ratio sees one machine load; its median is
    steadier on a shared machine than the ratio of the two medians.
    """
    return float(statistics.median(c / x for x, c in zip(lib, ceiling, strict=True)))


def _codec_figures(
    pool: ThreadPoolExecutor, store: Any, m: Any, new: Mapping[str, Any], prev: Mapping[str, Any], args: Any
) -> dict[str, Any]:
    """Size and throughput of one delta, library against the ceiling, reps interleaved.

    Decode is measured twice, the same way for library and ceiling: into memory already touched
    (what a worker does: it decodes into the version it held before last) and into fresh memory,
    where the kernel faults in and zeroes every page first.
    """
    from slipstream.weights import decode_version, encode_version, fetch_verified

    shards = fetch_verified(store, m)
    old_bits, new_bits = _flat_bits(prev), _flat_bits(new)
    c_enc, c_dec, c_size = _ceiling(pool, old_bits, new_bits, args.threads, args.level)
    lib_out = decode_version(m, shards, prev, threads=args.threads)
    c_out = c_dec()
    times = _interleaved(
        {
            "lib_encode": lambda: encode_version(new, prev, threads=args.threads, level=args.level),
            "ceiling_encode": c_enc,
            "lib_decode": lambda: decode_version(m, shards, prev, threads=args.threads, out=lib_out),
            "ceiling_decode": lambda: c_dec(c_out),
            "lib_decode_fresh": lambda: decode_version(m, shards, prev, threads=args.threads),
            "ceiling_decode_fresh": c_dec,
        },
        args.reps,
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    raw = m.raw_bytes
    step = {
        "version": m.policy_version,
        "changed_fraction": float((old_bits != new_bits).mean()),
        "raw_bytes": raw,
        "stored_bytes": m.stored_bytes,
        "stored_fraction": m.stored_bytes / raw,
        "ratio": raw / m.stored_bytes,
        "ceiling_ratio": raw / c_size,
        "encodings": {e: sum(t.encoding == e for t in m.tensors) for e in ("xor", "sparse", "full")},
        "encode_MB_s": raw / med["lib_encode"] / MB,
        "decode_MB_s": raw / med["lib_decode"] / MB,
        "ceiling_encode_MB_s": raw / med["ceiling_encode"] / MB,
        "ceiling_decode_MB_s": raw / med["ceiling_decode"] / MB,
        "decode_fresh_MB_s": raw / med["lib_decode_fresh"] / MB,
        "ceiling_decode_fresh_MB_s": raw / med["ceiling_decode_fresh"] / MB,
    }
    step["encode_share"] = _share(times["lib_encode"], times["ceiling_encode"])
    step["decode_share"] = _share(times["lib_decode"], times["ceiling_decode"])
    step["decode_fresh_share"] = _share(times["lib_decode_fresh"], times["ceiling_decode_fresh"])
    return step


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    import copy

    import torch
    import torch.nn.functional as F

    from slipstream.engine import TorchEngine, build_tiny, count_parameters
    from slipstream.store import LocalObjectStore
    from slipstream.weights import load_version, publish_version

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    lrs = [float(x) for x in args.lrs.split(",") if x]
    model, tok = build_tiny(args.preset, seed=args.seed)
    vocab = model.config.vocab_size
    n_params = count_parameters(model)
    gen = torch.Generator().manual_seed(args.seed + 1)

    def train_step(opt: torch.optim.Optimizer) -> float:
        x = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen)
        loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, vocab), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.item())

    def bf16() -> dict[str, torch.Tensor]:
        return {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}

    _log(f"{args.preset}: {n_params / 1e6:.2f}M params, {2 * n_params / MB:.1f} MB in bf16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01)
    t0 = time.perf_counter()
    loss = 0.0
    for _ in range(args.warmup):
        loss = train_step(opt)
    _log(f"warm-up: {args.warmup} steps at lr 1e-4 in {time.perf_counter() - t0:.1f}s, loss {loss:.3f}")
    warm_model, warm_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())

    serving, _ = build_tiny(args.preset, seed=args.seed, dtype=torch.bfloat16)
    engine = TorchEngine(serving, tok, max_batch=4, max_seq_len=512, dtype=torch.bfloat16, device="cpu")
    engine_thread = _Generator(engine, tok.encode("12+34="))
    out: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(prefix="slipstream-bench-weights-") as tmp,
        ThreadPoolExecutor(args.threads, thread_name_prefix="bench-ceiling") as pool,
    ):
        store = LocalObjectStore(Path(tmp) / "store")
        engine_thread.start()
        try:
            for li, lr in enumerate(lrs):
                model.load_state_dict(warm_model)
                opt.load_state_dict(warm_opt)
                for g in opt.param_groups:
                    g["lr"] = lr
                run_id = f"bench-lr{lr:g}"
                base_version = li * 1000  # the engine's versions only ever go up
                prev = bf16()
                key0 = publish_version(store, run_id=run_id, version=base_version, tensors=prev, threads=args.threads)
                held = load_version(store, run_id, base_version, threads=args.threads)
                spare: dict[str, torch.Tensor] | None = None  # what the rollout worker decodes into
                keyframe = {
                    "stored_fraction": key0.manifest.stored_bytes / key0.manifest.raw_bytes,
                    "encode_MB_s": key0.manifest.raw_bytes / key0.encode_s / MB,
                }
                engine.apply_weights(base_version, held)
                engine_thread.wait_for(base_version)
                steps = []
                for s in range(1, args.steps + 1):
                    version = base_version + s
                    loss = train_step(opt)
                    t_end = time.perf_counter()
                    new = bf16()  # the learner's hand-off copy is on the path too
                    pub = publish_version(
                        store,
                        run_id=run_id,
                        version=version,
                        tensors=new,
                        base=(version - 1, prev),
                        keyframe_every=1_000_000,
                        threads=args.threads,
                    )
                    t_stored = time.perf_counter()
                    # announce -> worker: resolve, fetch + verify, decode onto the version it holds
                    held, spare = (
                        load_version(
                            store, run_id, version, have=(version - 1, held), spare=spare, threads=args.threads
                        ),
                        held,
                    )
                    t_decoded = time.perf_counter()
                    engine.apply_weights(version, held)
                    t_policy = engine_thread.wait_for(version)
                    if not _same_bits(held, new):
                        raise AssertionError(f"version {version} did not decode to the published bits")
                    engine_thread.pause()
                    step = _codec_figures(pool, store, pub.manifest, new, prev, args)
                    engine_thread.resume()
                    step.update(
                        loss=loss,
                        pause_ms=engine_thread.pauses_ms[version],
                        time_to_policy_s=t_policy - t_end,
                        publish_s=t_stored - t_end,
                        fetch_decode_s=t_decoded - t_stored,
                    )
                    steps.append(step)
                    _log(
                        f"lr {lr:g} step {s}: 1/{step['ratio']:.1f} of raw, "
                        f"enc {step['encode_MB_s']:.0f} MB/s ({step['encode_share']:.0%} of ceiling), "
                        f"dec {step['decode_MB_s']:.0f} MB/s ({step['decode_share']:.0%}), "
                        f"pause {step['pause_ms']:.1f} ms, time-to-policy {step['time_to_policy_s'] * 1e3:.0f} ms"
                    )
                    prev = new
                out[f"{lr:g}"] = {"lr": lr, "keyframe": keyframe, "steps": steps, "summary": _summarize(steps)}
        finally:
            engine_thread.stop()
    return {
        "meta": {
            "preset": args.preset,
            "n_params": n_params,
            "raw_bf16_bytes": 2 * n_params,
            "warmup": args.warmup,
            "steps": args.steps,
            "reps": args.reps,
            "threads": args.threads,
            "zstd_level": args.level,
            "torch": torch.__version__,
        },
        "lrs": out,
    }


def _summarize(steps: list[dict[str, Any]]) -> dict[str, float]:
    def med(k: str) -> float:
        return float(statistics.median(s[k] for s in steps))

    keys = (
        "ratio",
        "ceiling_ratio",
        "encode_MB_s",
        "decode_MB_s",
        "ceiling_encode_MB_s",
        "ceiling_decode_MB_s",
        "decode_fresh_MB_s",
        "ceiling_decode_fresh_MB_s",
    )
    summary = {k: med(k) for k in keys}
    summary["worst_stored_fraction"] = max(s["stored_fraction"] for s in steps)
    for k in ("encode_share", "decode_share", "decode_fresh_share"):
        summary[k] = med(k)
    summary["max_pause_ms"] = max(s["pause_ms"] for s in steps)
    summary["max_time_to_policy_s"] = max(s["time_to_policy_s"] for s in steps)
    return summary


def _targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(name: str, value: float, target: float, at_most: bool) -> None:
        ok = value <= target if at_most else value >= target
        out.append({"name": name, "value": value, "target": target, "at_most": at_most, "pass": ok})

    for key, r in res["lrs"].items():
        s = r["summary"]
        if r["lr"] in FRACTION_TARGETS:
            add(f"lr {key}: stored fraction (worst step)", s["worst_stored_fraction"], FRACTION_TARGETS[r["lr"]], True)
        add(f"lr {key}: encode MB/s", s["encode_MB_s"], ENCODE_MB_S, False)
        add(f"lr {key}: decode MB/s", s["decode_MB_s"], DECODE_MB_S, False)
        add(f"lr {key}: encode / ceiling", s["encode_share"], CEILING_SHARE, False)
        add(f"lr {key}: decode / ceiling", s["decode_share"], CEILING_SHARE, False)
        add(f"lr {key}: in-flight pause ms (max)", s["max_pause_ms"], PAUSE_MS, True)
        add(f"lr {key}: time-to-policy s (max)", s["max_time_to_policy_s"], TIME_TO_POLICY_S, True)
    return out


def _table(res: dict[str, Any]) -> str:
    m = res["meta"]
    lines = [
        f"{m['preset']}: {m['n_params'] / 1e6:.2f}M params, {m['raw_bf16_bytes'] / MB:.1f} MB bf16; "
        f"{m['threads']} threads, zstd-{m['zstd_level']}; MB/s = raw MB per second, median of {m['reps']} reps",
        "",
        "| lr | step | changed | delta / raw | ratio (ceiling) | enc MB/s (ceiling) | dec MB/s (ceiling) "
        "| dec into fresh memory (ceiling) | pause ms | time-to-policy ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, r in res["lrs"].items():
        for i, s in enumerate(r["steps"], 1):
            lines.append(
                f"| {key} | {i} | {s['changed_fraction']:.2%} | {s['stored_fraction']:.4f} "
                f"| {s['ratio']:.1f} ({s['ceiling_ratio']:.1f}) "
                f"| {s['encode_MB_s']:.0f} ({s['ceiling_encode_MB_s']:.0f}) "
                f"| {s['decode_MB_s']:.0f} ({s['ceiling_decode_MB_s']:.0f}) "
                f"| {s['decode_fresh_MB_s']:.0f} ({s['ceiling_decode_fresh_MB_s']:.0f}) "
                f"| {s['pause_ms']:.1f} | {s['time_to_policy_s'] * 1e3:.0f} |"
            )
        k = r["keyframe"]
        lines.append(f"| {key} | keyframe | 100% | {k['stored_fraction']:.4f} | | {k['encode_MB_s']:.0f} | | | | |")
    lines += ["", "| target | value | goal | |", "|---|---:|---:|---|"]
    for t in res["targets"]:
        goal = ("<= " if t["at_most"] else ">= ") + f"{t['target']:.4g}"
        lines.append(f"| {t['name']} | {t['value']:.4g} | {goal} | {'pass' if t['pass'] else 'FAIL'} |")
    lines.append("")
    lines.append(
        "meets every target"
        if res["meets_targets"]
        else "BELOW TARGET on: " + ", ".join(t["name"] for t in res["targets"] if not t["pass"])
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure, print the table, write the JSON (when --json is given); return the results."""
    res = _measure(args)
    res["targets"] = _targets(res)
    res["meets_targets"] = all(t["pass"] for t in res["targets"])
    print(_table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.json}")
    return res
