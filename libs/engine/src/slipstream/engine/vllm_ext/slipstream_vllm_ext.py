"""Runs inside a vLLM worker process (`--worker-extension-cls slipstream_vllm_ext.WeightLoader`).

vLLM mixes this class into its GPU/CPU worker, and `POST /collective_rpc` (a server started with
`VLLM_SERVER_DEV_MODE=1`) calls its methods on every worker. `VllmEngine` (vllm_engine.py) puts
this directory, not the slipstream package, on the server's PYTHONPATH: the module imports only
the standard library, torch and safetensors, which .venv-vllm has, and nothing of Slipstream.

`slipstream_load` reads a safetensors file the engine wrote (Hugging Face state_dict names, the
same the learner publishes) and hands every tensor to the model's own `load_weights`, which maps
HF names onto vLLM's fused parameters (q/k/v into qkv_proj, gate/up into gate_up_proj) and copies
them in place. A file holding only some tensors changes only those (a partial version); vLLM's
built-in `reload_weights`, by contrast, zeroes every weight its directory does not hold.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from safetensors.torch import load_file


class WeightLoader:
    """Methods vLLM adds to its worker; `self` is the worker (it has `model_runner`)."""

    model_runner: Any

    def slipstream_load(self, path: str) -> dict[str, float]:
        """Copy the tensors of the safetensors file at `path` into the served model, in place."""
        t0 = time.perf_counter()
        tensors = load_file(path, device="cpu")
        model = self.model_runner.model
        with torch.no_grad():
            loaded = model.load_weights(weights=list(tensors.items()))
        return {
            "tensors": float(len(tensors)),
            "params_loaded": float(len(loaded) if loaded is not None else -1),
            "seconds": time.perf_counter() - t0,
        }

    def slipstream_checksum(self) -> float:
        """Sum of every parameter of the served model (tests tell weight versions apart by it)."""
        with torch.no_grad():
            return float(sum(p.detach().double().sum().item() for p in self.model_runner.model.parameters()))
