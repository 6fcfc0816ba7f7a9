"""A content-addressed cache of warm-started models (the `code` and `search` demos' version 0, issues 33-34).

Those demos' warm-starts (an expert's pool played in sandboxes or against the search backend, then
supervised steps to a probe target) dominate their wall time and depend only on the plan's
warm-start fields and the code that plays and trains. Its result is kept under a digest of both:
the plan's `sft_*` fields, env, env options, preset, seed, temperature and summary; torch's
version; and the bytes of every Python file of the packages involved (envs, harness, supervised,
engine, tools, sandbox, retrieval). Any change to either is a new digest, so a cached model is
never reused for a different warm-start. The cache lives in `$SLIPSTREAM_WARMSTART_CACHE`
(default `~/.cache/slipstream/warmstart`); a hit copies the model into the run and returns the
stored figures with `cached` set to the digest.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import msgspec

PACKAGES = (
    "slipstream.envs",
    "slipstream.harness",
    "slipstream.supervised",
    "slipstream.engine",
    "slipstream.toolcalls",
    "slipstream.sandbox",
    "slipstream.retrieval",
)
CACHED_ENVS = frozenset({"code", "search"})
"""The demos whose warm-start `initial_model` caches: a cold one costs 30-60 minutes on 2 cores."""
PLAN_FIELDS = ("env", "env_options", "preset", "seed", "temperature", "summary", "model")
REWARD_ONLY_OPTIONS = ("length_penalty", "beta_final", "beta_anneal_versions")
"""Env options that only shape RL's reward: the warm-start (the expert's episodes, supervised steps and
the probe's pass rate) never reads them, so runs that differ only in these share a warm-start."""


def cache_root() -> Path:
    return Path(os.environ.get("SLIPSTREAM_WARMSTART_CACHE") or Path.home() / ".cache" / "slipstream" / "warmstart")


def source_digest(packages: tuple[str, ...] = PACKAGES) -> str:
    """A digest of every .py file under `packages` (path and bytes), in sorted order."""
    h = hashlib.blake2b(digest_size=16)
    for name in packages:
        for base in importlib.import_module(name).__path__:
            for path in sorted(Path(base).rglob("*.py")):
                h.update(str(path.relative_to(base)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def plan_digest(plan: Any, sources: str) -> str:
    fields = msgspec.to_builtins(plan)
    kept = {k: v for k, v in fields.items() if k in PLAN_FIELDS or k.startswith("sft_")}
    kept["env_options"] = {k: v for k, v in (kept.get("env_options") or {}).items() if k not in REWARD_ONLY_OPTIONS}
    text = json.dumps(
        {"plan": kept, "torch": metadata.version("torch"), "sources": sources}, sort_keys=True, default=str
    )
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def cached_warm_start(
    plan: Any,
    model_dir: Path,
    make: Callable[[], dict[str, Any]],
    root: Path | None = None,
    sources: str | None = None,
) -> dict[str, Any]:
    """`make()` (which writes version 0 into `model_dir` and returns its figures) unless a model for
    the same plan and code (`sources`, default `source_digest()`) is cached; either way `model_dir`
    holds the model afterwards."""
    root = root or cache_root()
    digest = plan_digest(plan, sources if sources is not None else source_digest())
    entry = root / digest
    if (entry / "figures.json").exists():
        shutil.copytree(entry / "model", model_dir, dirs_exist_ok=True)
        return {**json.loads((entry / "figures.json").read_text()), "cached": digest}
    figures = make()
    staging = root / f".{digest}.{uuid.uuid4().hex[:8]}"
    shutil.copytree(model_dir, staging / "model")
    (staging / "figures.json").write_text(json.dumps(figures, default=str))
    try:
        staging.rename(entry)  # atomic: a concurrent run with the same digest keeps its own
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return figures


def given_figures(model_dir: Path) -> dict[str, Any]:
    """What made a given model, where `python -m slipstream.run.warmstart_many` left it beside the
    model (figures.json: steps, probe, device, torch, sources); {} for any other model."""
    path = model_dir.parent / "figures.json"
    if not path.is_file():
        return {}
    try:
        figures = json.loads(path.read_text())
    except ValueError:
        return {}
    made = {k: v for k, v in figures.items() if isinstance(v, (int, float, str)) and k != "wall_s"}
    if "wall_s" in figures:
        made["made_wall_s"] = figures["wall_s"]
    return made


def code_changed(figures: dict[str, Any], sources: str | None = None) -> str:
    """Why a given model may not be the warm-start this checkout would make: its figures name the
    digest of the code that made it (`sources`, from warmstart_many) and this checkout's differs;
    "" where they agree or the figures do not say."""
    made = figures.get("sources")
    if not isinstance(made, str) or not made:
        return ""
    now = sources if sources is not None else source_digest()
    if made == now:
        return ""
    return (
        f"it was made by code with digest {made} and this checkout's is {now}: the env, harness or engine code "
        "changed since, so this checkout's warm-start could differ"
    )


def given_model(model_dir: Path) -> tuple[dict[str, Any], str]:
    """A model given with `--init-model`, as RL's initial model: what made it (`given_figures`),
    marked given, and `code_changed`'s note ("" if none), for both demos."""
    figures = {**given_figures(model_dir), "init_model": str(model_dir), "given": True}
    return figures, code_changed(figures)
