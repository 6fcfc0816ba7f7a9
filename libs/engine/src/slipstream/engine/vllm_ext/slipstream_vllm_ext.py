"""Runs inside a vLLM worker process (`--worker-extension-cls slipstream_vllm_ext.WeightLoader`).

vLLM mixes this class into its GPU/CPU worker, and `POST /collective_rpc` (a server started with
`VLLM_SERVER_DEV_MODE=1`) calls its methods on every worker. `VllmEngine` (vllm_engine.py) puts
this directory, not the slipstream package, on the server's PYTHONPATH: the module imports only
the standard library, torch and safetensors, which .venv-vllm has, and nothing of Slipstream.

`slipstream_load` reads a safetensors file the engine wrote (Hugging Face state_dict names, the
same the learner publishes) and hands the tensors to the model runner's in-place `reload_weights`,
which maps HF names onto vLLM's fused parameters (q/k/v into qkv_proj, gate/up into gate_up_proj).
Give it full versions: vLLM's reload from a directory holding only some tensors zeroed the others
(../shared/reference/vllm-cpu.md), and a partial iterator is not tested here.
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
        # The runner's in-place reload, not the model's `load_weights`: the CPU build repacks linear
        # weights after loading (leaving the registered parameters empty), and the reload restores the
        # checkpoint layout, loads, and repacks again.
        with torch.no_grad():
            self.model_runner.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        return {"tensors": float(len(tensors)), "seconds": time.perf_counter() - t0}

    def slipstream_checksum(self) -> float:
        """Sum of every parameter of the served model (tests tell weight versions apart by it)."""
        with torch.no_grad():
            return float(sum(p.detach().double().sum().item() for p in self.model_runner.model.parameters()))
