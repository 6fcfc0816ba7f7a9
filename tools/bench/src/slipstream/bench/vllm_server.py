"""vLLM as the third backend of `slipstream bench engine` (`--vllm`).

The bench's engine rows time the Slipstream engine and HF `generate` on the same prompts; with
`--vllm` a vLLM server (`VllmEngine`, libs/engine vllm_engine.py, started from the vLLM venv's
Python) is timed on those prompts too, in the same repeats, through the same Engine protocol calls
the Slipstream engine gets. One server per dtype, started before that dtype's models are loaded (so
its start time is not shared with anything of the bench's) and stopped after its last batch; never
two at once. The JSON's `vllm` section says whether it ran and, if not, why; per dtype it records
the server's start time and the RSS of its whole process group (API server, engine core, worker)
when ready and after the last batch.

The vLLM Python: `--vllm-python`, else SLIPSTREAM_ENGINE__VLLM_PYTHON (the variable behind
`[engine] vllm_python`), else that field's default, `.venv-vllm/bin/python` (`make vllm-venv`).
Threads: `--vllm-threads`, by default `--threads` (0: one bound to every core, vLLM's fast setting
on cores it has alone; N: N unbound OpenMP threads, what shared cores need).
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slipstream.engine.vllm_engine import VllmEngine

PYTHON_ENV = "SLIPSTREAM_ENGINE__VLLM_PYTHON"
NOT_ASKED = "not asked for (pass --vllm to time vLLM on the same prompts)"


def add_vllm_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of the vLLM backend of `bench engine`."""
    g = p.add_argument_group("vLLM (a third backend, opt-in)")
    g.add_argument(
        "--vllm",
        action="store_true",
        help="also time vLLM (a server from the vLLM venv) on the same prompts, in the same repeats",
    )
    g.add_argument(
        "--vllm-python",
        default="",
        help=f"the vLLM venv's python (default: ${PYTHON_ENV}, else .venv-vllm/bin/python)",
    )
    g.add_argument(
        "--vllm-threads",
        type=int,
        default=-1,
        help="vLLM's CPU threads: 0 one bound to every core, N unbound (default: as --threads)",
    )
    g.add_argument(
        "--vllm-compile",
        action="store_true",
        help="let vLLM compile its model (CPU: ready in 2.5-4 min instead of ~30 s; faster steps)",
    )
    g.add_argument("--vllm-kv-cache-gb", type=int, default=1, help="vLLM's KV cache in GiB (default 1)")


@dataclass(frozen=True)
class VllmPlan:
    """Whether and how the bench runs vLLM; `skipped` says why not when it does not."""

    python: Path
    threads: int
    enforce_eager: bool
    kv_cache_gb: int
    skipped: str = ""

    @property
    def runs(self) -> bool:
        return not self.skipped


def vllm_plan(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> VllmPlan:
    """What `--vllm*` (and SLIPSTREAM_ENGINE__VLLM_PYTHON) ask for; a missing venv skips, saying where."""
    from slipstream.engine.backend import EngineBackend
    from slipstream.engine.vllm_setup import find_python

    if args.vllm_threads < -1:
        raise SystemExit(f"--vllm-threads must be -1 (as --threads), 0 or more, got {args.vllm_threads}")
    if args.vllm_kv_cache_gb < 1:
        raise SystemExit(f"--vllm-kv-cache-gb must be 1 or more, got {args.vllm_kv_cache_gb}")
    env = os.environ if environ is None else environ
    given = args.vllm_python or env.get(PYTHON_ENV, "") or EngineBackend().vllm_python
    python = find_python(Path(given))
    skipped = ""
    if not args.vllm:
        skipped = NOT_ASKED
    elif args.no_generation:
        skipped = "--no-generation: there are no engine rows to time it beside"
    elif not python.is_file():
        skipped = f"no vLLM python at {python} (build it with `make vllm-venv`; or --vllm-python / ${PYTHON_ENV})"
    return VllmPlan(
        python=python,
        threads=args.threads if args.vllm_threads == -1 else args.vllm_threads,
        enforce_eager=not args.vllm_compile,
        kv_cache_gb=args.vllm_kv_cache_gb,
        skipped=skipped,
    )


async def start_vllm(plan: VllmPlan, model_dir: Path, dtype: str, max_model_len: int) -> tuple[VllmEngine, dict]:
    """A started VllmEngine over `model_dir` and its start figures (seconds to ready, group RSS)."""
    from slipstream.engine.vllm_engine import VllmEngine

    engine = VllmEngine(
        model_dir,
        python=plan.python,
        dtype=dtype,
        max_model_len=max_model_len,
        kv_cache_gb=plan.kv_cache_gb,
        enforce_eager=plan.enforce_eager,
        threads=plan.threads,
        start_timeout_s=1800.0,
    )
    load = os.getloadavg()[0]
    await engine.start()
    figures = {
        "dtype": dtype,
        "start_s": round(engine.stats()["start_s"], 1),
        "rss_mb_ready": server_rss_mb(engine),
        "load_avg_at_start": load,
        "load_avg_ready": os.getloadavg()[0],
    }
    print(f"vLLM {dtype}: ready in {figures['start_s']:.1f} s, {figures['rss_mb_ready']:.0f} MB RSS", flush=True)
    return engine, figures


def server_rss_mb(engine: VllmEngine) -> float:
    """RSS of the server's whole process group (it leads its own group), in MB."""
    from slipstream.engine.vllm_setup import group_rss_mb

    return round(group_rss_mb(engine.proc.pid), 1) if engine.proc is not None else 0.0


def process_peak_rss_mb() -> float:
    """This process's peak RSS so far, in MB: the Slipstream engine and the HF model live here."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def timed_load(load: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """`load(*args, **kwargs)` and the seconds it took."""
    t0 = time.perf_counter()
    out = load(*args, **kwargs)
    return out, round(time.perf_counter() - t0, 2)


def vllm_section(plan: VllmPlan, servers: list[dict]) -> dict[str, Any]:
    """The JSON's `vllm` section: ran or skipped (and why), how, and each server's start and memory."""
    return {
        "ran": plan.runs,
        "skipped_because": plan.skipped or None,
        "python": str(plan.python),
        "threads": plan.threads,
        "enforce_eager": plan.enforce_eager,
        "kv_cache_gb": plan.kv_cache_gb,
        "servers": servers,
    }
