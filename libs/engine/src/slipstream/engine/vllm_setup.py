"""What `VllmEngine` (vllm_engine.py) needs around its vLLM server: the checkpoint's parameter list,
the HF directory a `[model]` is served from, where the vLLM venv's Python is, a free port, the
memory of the server's process group, and ending that group."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from slipstream.engine.interface import ParamSpec

if TYPE_CHECKING:
    from slipstream.engine.source import ModelSource

_TIED_ALIAS = {"lm_head.weight": "model.embed_tokens.weight"}


def checkpoint_specs(model_dir: Path) -> tuple[dict[str, ParamSpec], dict[str, str]]:
    """Name -> (shape, dtype) of every tensor of an HF directory, and the tied-embedding alias if any."""
    from safetensors import safe_open

    from slipstream.engine.loading import _weight_files

    specs: dict[str, ParamSpec] = {}
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                sl = f.get_slice(name)
                specs[name] = ParamSpec(tuple(sl.get_shape()), _dtype_name(sl.get_dtype()))
    config = json.loads((model_dir / "config.json").read_text())
    aliases = dict(_TIED_ALIAS) if config.get("tie_word_embeddings") else {}
    if aliases:
        specs.pop("lm_head.weight", None)
    return specs, aliases


def _dtype_name(safetensors_dtype: str) -> str:
    return {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}.get(
        safetensors_dtype, safetensors_dtype.lower()
    )


def model_dir_for(source: ModelSource) -> Path:
    """The HF directory vLLM serves for `[model]`: its `path` or named model's directory, or the preset
    (built from its seed) saved once as a Llama checkpoint under `cache_dir` (~/.cache/slipstream/vllm).
    With LoRA this is the frozen base; `VllmEngine` merges each version's adapters into it."""
    from slipstream.engine.source import model_path

    path = model_path(source)
    if path:
        return Path(path)
    from slipstream.engine.loading import save_pretrained
    from slipstream.engine.presets import PRESETS, build_tiny

    if PRESETS[source.preset].num_experts:
        raise ValueError(f"[engine] type = 'vllm' cannot serve preset {source.preset!r}: vLLM has no Slipstream MoE")
    root = Path(source.cache_dir or Path.home() / ".cache" / "slipstream" / "vllm")
    directory = root / f"{source.preset}-seed{source.seed}-{source.dtype}"
    if not (directory / "config.json").is_file():
        import torch

        model, tokenizer = build_tiny(source.preset, seed=source.seed, dtype=getattr(torch, source.dtype))
        root.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=directory.name + ".", dir=root))
        save_pretrained(model, tokenizer, partial)
        with contextlib.suppress(OSError):  # another process wrote the same directory first
            partial.rename(directory)
    return directory


def find_python(python: Path) -> Path:
    """`python` as given, or, when relative and absent from here, under the checkout this module is in
    (a service of the local stack runs in its own directory, the venv lies in the repository root)."""
    if python.is_absolute() or python.exists():
        return python
    for parent in Path(__file__).resolve().parents:
        if (parent / "Makefile").is_file() and (parent / python).exists():
            return parent / python
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def group_rss_mb(pgid: int) -> float:
    """Resident memory of every process in group `pgid` (a vLLM server's API server, engine core and
    workers), in MB, read from /proc; 0.0 when the group is gone."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:  # fields after the name: state, ppid, pgrp, ...
                continue
            # statm's resident pages (stat's rss field lags: the kernel batches its counters per CPU)
            total += int((entry / "statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e6


def terminate_group(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """SIGTERM the process group `proc` leads, SIGKILL it after `grace_s`; reaps `proc`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        # The leader is gone; its children (engine core, workers) may outlive it by a moment.
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
