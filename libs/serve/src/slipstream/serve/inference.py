"""Entry point of Slipstream's inference server: `python -m slipstream.serve.inference`
(also `slipstream serve-engine`).

Loads `[model]` into a TorchEngine and serves it with `InferenceServer` until SIGTERM or
SIGINT; then in-flight calls are aborted (they answer with finish_reason 'abort') and the
socket closes. Config is parsed before torch is imported, so `--help` is instant; flags are
`--server.port 8100`, `--model.preset tiny`, ... (`--print-config` shows the resolved config).
The first line on stdout is `listening on http://HOST:PORT`, naming the bound port when
`--server.port 0` picked a free one.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Sequence

from slipstream.runtime.config import parse_cli
from slipstream.serve.config import InferenceServerConfig


async def serve(cfg: InferenceServerConfig, stop: asyncio.Event) -> None:
    """Serve `cfg` until `stop` is set."""
    from slipstream.engine.engine import TorchEngine
    from slipstream.engine.source import load_model, resolve_device, torch_dtype
    from slipstream.serve.inference_server import InferenceServer

    model, tokenizer = await asyncio.to_thread(load_model, cfg.model)
    s = cfg.server
    engine = TorchEngine(
        model,
        tokenizer,
        max_batch=s.max_batch,
        max_seq_len=s.max_seq_len or None,
        device=resolve_device(cfg.model),
        dtype=torch_dtype(cfg.model),
        seed=cfg.model.seed,
        recompute_kv_on_update=s.recompute_kv_on_update,
        speculative_tokens=s.speculative_tokens,
        # A LoRA run's versions are its adapters only; the frozen base stays as loaded.
        allow_partial_updates=cfg.model.lora_rank > 0,
    )
    server = InferenceServer(engine, s)
    await server.start()
    sys.stdout.write(f"listening on {server.url}\n")
    sys.stdout.flush()
    try:
        await stop.wait()
    finally:
        await server.close()


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_cli(
        InferenceServerConfig,
        argv,
        prog="slipstream-inference",
        description="Slipstream's inference server: token-id generate, in-flight weight updates (HttpEngine's server).",
    )

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg, stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
