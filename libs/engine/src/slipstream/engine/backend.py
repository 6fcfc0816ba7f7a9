"""`[engine]`: which inference engine a rollout worker drives, chosen by `type`.

`torch` runs the model in the worker's own process (`TorchEngine`, loaded from `[model]`).
`http` drives a dedicated inference server over its token-id HTTP API (`HttpEngine` in
slipstream.serve, against `python -m slipstream.serve.inference`); the worker then loads only
the tokenizer named by `[model]`, which must be the server's. This module imports no torch and
no aiohttp, so a config class can hold it and `--help` stays instant.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

Doc = msgspec.Meta

EngineType = Literal["torch", "http"]


class EngineBackend(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`[engine]`: the engine implementation and, for `http`, where its server is."""

    type: Annotated[
        EngineType,
        Doc(description="'torch': the model runs in this process; 'http': a Slipstream inference server at `url`."),
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
        float, Doc(description="Longest upload-and-apply of one weight version (type 'http').", gt=0)
    ] = 300.0

    def __post_init__(self) -> None:
        if self.type == "http" and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"[engine] type = 'http' needs url = 'http://host:port', got {self.url!r}")
