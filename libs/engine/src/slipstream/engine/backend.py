"""`[engine]`: which inference engine a rollout worker drives, chosen by `type`.

`torch` runs the model in the worker's own process (`TorchEngine`, loaded from `[model]`).
`http` drives a dedicated inference server over its token-id HTTP API (`HttpEngine` in
slipstream.serve, against `python -m slipstream.serve.inference`); the worker then loads only
the tokenizer named by `[model]`, which must be the server's. `vllm` starts a vLLM server of its
own from `vllm_python` (`make vllm-venv`) over `[model]` written as a Hugging Face directory, and
drives it (`VllmEngine`, vllm_engine.py). This module imports no torch and no aiohttp, so a config
class can hold it and `--help` stays instant.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

Doc = msgspec.Meta

EngineType = Literal["torch", "http", "vllm"]


class EngineBackend(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`[engine]`: the engine implementation and, for `http`, where its server is."""

    type: Annotated[
        EngineType,
        Doc(
            description="'torch': the model runs in this process; 'http': a Slipstream inference server at `url`; "
            "'vllm': a vLLM server this process starts (from `vllm_python`) and stops."
        ),
    ] = "torch"
    url: Annotated[
        str, Doc(description="Base URL of the inference server (type 'http'), e.g. http://inference-0:8100.")
    ] = ""
    connect_timeout_s: Annotated[
        float, Doc(description="Longest wait to open a connection to the server before it counts as unreachable.", gt=0)
    ] = 10.0
    request_timeout_s: Annotated[
        float, Doc(description="Longest one generate call may take, queueing included; then it is aborted.", gt=0)
    ] = 600.0
    weights_timeout_s: Annotated[
        float, Doc(description="Longest upload-and-apply of one weight version (types 'http', 'vllm').", gt=0)
    ] = 300.0
    vllm_python: Annotated[
        str, Doc(description="The Python of the venv vLLM is installed in (type 'vllm'; `make vllm-venv` builds it).")
    ] = ".venv-vllm/bin/python"
    vllm_start_timeout_s: Annotated[
        float, Doc(description="Longest wait for the vLLM server to answer /health after it is started.", gt=0)
    ] = 600.0
    vllm_kv_cache_gb: Annotated[
        int, Doc(description="KV cache vLLM reserves, in GiB (VLLM_CPU_KVCACHE_SPACE on a CPU build).", ge=1)
    ] = 1
    vllm_max_model_len: Annotated[
        int, Doc(description="Longest prompt + completion vLLM serves (--max-model-len); 0: the model's own.", ge=0)
    ] = 2048
    vllm_enforce_eager: Annotated[
        bool, Doc(description="Skip vLLM's graph compilation: ~30 s to ready, not 2.5-4 min (CPU); slower steps.")
    ] = True
    vllm_threads: Annotated[
        int,
        Doc(
            description="vLLM's CPU threads, unbound; 0: one bound to every core (fastest on cores it has alone).", ge=0
        ),
    ] = 0
    vllm_args: Annotated[list[str], Doc(description="Extra command-line arguments for the vLLM server.")] = []

    def __post_init__(self) -> None:
        if self.type == "http" and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"[engine] type = 'http' needs url = 'http://host:port', got {self.url!r}")
