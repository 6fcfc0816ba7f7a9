"""One process serving one model as an OpenAI-compatible, recording endpoint (`slipstream serve`).

Without a training stack: `[model]` (a preset, a named model, or a Hugging Face directory) is
loaded into a TorchEngine, the endpoint of `slipstream.serve.server` is opened over it with
`[endpoint]`'s settings, and each session's calls are assembled into episodes as a serving
worker assembles them, kept in memory or, with `record_dir`, written to a local object store
there (`episodes/<run>/...`, readable by the store's tools). The model's own chat template picks
the prompt format unless `[endpoint] renderer` names one. `serve` returns when `stop` is set,
after closing the endpoint (every open session is flushed to the sink first) and the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import msgspec

from slipstream.engine.source import ModelSource
from slipstream.serve.config import ServeConfig

Doc = msgspec.Meta


class StandaloneSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How the engine behind a standalone endpoint runs, and where its episodes go."""

    max_batch: Annotated[int, Doc(description="Completions decoded together in one batch.", ge=1)] = 16
    max_seq_len: Annotated[int, Doc(description="Longest prompt + completion; 0 = the model's (<= 2048).", ge=0)] = 0
    record_dir: Annotated[
        str, Doc(description="Local object store the episodes are written to; '' keeps them in memory only.")
    ] = ""
    run_id: Annotated[str, Doc(description="Run id the recorded episodes are stored under.")] = "serve"


class StandaloneConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`slipstream serve`: a model and the endpoint in front of it."""

    model: Annotated[ModelSource, Doc(description="What is served: preset, named model or directory.")] = msgspec.field(
        default_factory=ModelSource
    )
    endpoint: Annotated[ServeConfig, Doc(description="The OpenAI-compatible endpoint (always on here).")] = (
        msgspec.field(default_factory=ServeConfig)
    )
    serve: Annotated[StandaloneSection, Doc(description="Engine batch and length limits; where episodes go.")] = (
        msgspec.field(default_factory=StandaloneSection)
    )


def served_name(source: ModelSource) -> str:
    """The model id clients name when `[endpoint] model_name` is empty: the named model, the
    directory's name, or the preset."""
    if source.path:
        return Path(source.path).name or "model"
    return source.name or source.preset


async def serve(cfg: StandaloneConfig, stop: asyncio.Event, on_ready: Callable[[str, str], None] | None = None) -> None:
    """Serve until `stop` is set; `on_ready(url, model id)` hears the bound address once it listens."""
    from slipstream.engine.engine import TorchEngine
    from slipstream.engine.source import load_model, resolve_device, torch_dtype
    from slipstream.serve.record import EpisodeSink, MemorySink, StoreSink
    from slipstream.serve.server import ServeEndpoint

    model, tokenizer = await asyncio.to_thread(load_model, cfg.model)
    engine = TorchEngine(
        model,
        tokenizer,
        max_batch=cfg.serve.max_batch,
        max_seq_len=cfg.serve.max_seq_len or None,
        device=resolve_device(cfg.model),
        dtype=torch_dtype(cfg.model),
        seed=cfg.model.seed,
    )
    sink: EpisodeSink = MemorySink()
    if cfg.serve.record_dir:
        from slipstream.store import LocalObjectStore

        sink = StoreSink(LocalObjectStore(cfg.serve.record_dir), cfg.serve.run_id)
    endpoint_cfg = msgspec.structs.replace(cfg.endpoint, enabled=True)
    await engine.start()
    endpoint = ServeEndpoint(engine, tokenizer, endpoint_cfg, sink, model_name=served_name(cfg.model))
    try:
        await endpoint.start()
        if on_ready is not None:
            on_ready(endpoint.base_url.replace("0.0.0.0", "127.0.0.1"), endpoint.model_name)
        await stop.wait()
    finally:
        await endpoint.close()
        await engine.stop()
