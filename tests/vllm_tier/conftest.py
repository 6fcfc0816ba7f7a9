"""The vllm tier: `VllmEngine` against a real vLLM server started from .venv-vllm (`make test-vllm`).

Every test here is marked `vllm`. They skip, saying why, when the vLLM venv is absent (`make
vllm-venv` builds it) and when the tier was not asked for with `-m vllm`: each module starts a vLLM
server (~30 s to minutes, ~1-4 GB), and two at once on a small machine would starve each other, so
`make test` (which runs on several xdist workers) never starts one.

The vLLM Python: SLIPSTREAM_ENGINE__VLLM_PYTHON (the variable behind `[engine] vllm_python`, so one
setting serves the tier, `slipstream bench engine --vllm` and a run), else SLIPSTREAM_VLLM_PYTHON,
else the repository's .venv-vllm/bin/python. `make test-vllm VLLM_VENV=DIR` sets the first to
DIR/bin/python, as `make vllm-venv VLLM_VENV=DIR` builds it (e.g. one venv shared by checkouts).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(
    os.environ.get("SLIPSTREAM_ENGINE__VLLM_PYTHON")
    or os.environ.get("SLIPSTREAM_VLLM_PYTHON")
    or REPO / ".venv-vllm" / "bin" / "python"
)
# vLLM's CPU threads (VllmEngine `threads`): 1, unbound, by default, since these machines' cores are shared;
# SLIPSTREAM_VLLM_THREADS=0 binds one to every core (the fast setting on a machine of one's own).
THREADS = int(os.environ.get("SLIPSTREAM_VLLM_THREADS", "1"))
_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if _HERE in Path(str(item.path)).parents]
    if not ours:
        return
    reason = ""
    if not VLLM_PYTHON.is_file():
        reason = (
            f"vllm tier: no vLLM venv at {VLLM_PYTHON} (build it with `make vllm-venv`, "
            "or name its python in SLIPSTREAM_ENGINE__VLLM_PYTHON)"
        )
    elif "vllm" not in (config.option.markexpr or ""):
        reason = "vllm tier: runs only when selected with -m vllm (`make test-vllm`), one vLLM server at a time"
    if reason:
        for item in ours:
            item.add_marker(pytest.mark.skip(reason=reason))
