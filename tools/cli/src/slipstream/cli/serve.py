"""`slipstream serve MODEL | RUN.toml`: one model behind an OpenAI-compatible, recording endpoint.

    slipstream serve smollm2-135m                  # a named model (converted once into the cache)
    slipstream serve ./my-qwen3 --port 0           # a Hugging Face directory; 0 picks a free port
    slipstream serve examples/search_call.toml     # a run file's [model] and [endpoint]
    slipstream serve tiny --record ./served        # episodes written to a local object store there

The model is checked before anything loads (an unknown name or a directory that is not a
model is one line naming it and what exists). Once the endpoint listens, the first line on
stdout is `serving MODEL at URL`, the base URL an `openai` client takes; Ctrl-C (or SIGTERM)
closes it, flushing every open session to the recorder first. The prompt format follows the
model's own chat template unless `--renderer` (or `[endpoint] renderer`) names one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model (a name, a directory or a run file's [model]) as an OpenAI-compatible recording endpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", metavar="MODEL|RUN.toml", help="preset (tiny), named model, model directory or run file")
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1, or the run file's)")
    p.add_argument("--port", type=int, default=None, help="port; 0 picks a free one (default 8000, or the run file's)")
    p.add_argument("--model-name", default=None, help="model id clients name (default: the model's name)")
    p.add_argument("--renderer", default=None, help="prompt format (smollm2, qwen2.5, tags); default: the model's")
    p.add_argument("--device", default=None, help="cpu, cuda or auto (default cpu, or the run file's)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="weights' dtype")
    p.add_argument("--max-batch", type=int, default=None, help="completions decoded together (default 16)")
    p.add_argument("--record", type=Path, default=None, metavar="DIR", help="write episodes to a local store at DIR")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.set_defaults(func=run, parser=p)


def resolve(args: argparse.Namespace) -> Any:
    """The standalone config for `args` (a ValueError names what is wrong)."""
    import msgspec

    from slipstream.engine.source import PRESET_NAMES, ModelSource
    from slipstream.run.modelcheck import check_model
    from slipstream.serve.config import ServeConfig
    from slipstream.serve.standalone import StandaloneConfig, StandaloneSection

    model: dict[str, Any] = {}
    endpoint: dict[str, Any] = {}
    serve: dict[str, Any] = {}
    target = str(args.target)
    if target.endswith(".toml"):
        from slipstream.run import load

        run_file = load(target)
        plan = run_file.plan()
        if plan.model:
            model["path" if Path(plan.model).is_absolute() else "name"] = plan.model
        else:
            model["preset"] = plan.preset
        model.update(device=plan.device, dtype=plan.rollout_dtype, seed=plan.seed)
        endpoint.update({k: v for k, v in plan.endpoint.items() if k != "enabled"})
        serve["run_id"] = run_file.name or "serve"
    elif target in PRESET_NAMES:
        model["preset"] = target
    else:
        checked = check_model(target)
        model["path" if Path(checked).is_absolute() else "name"] = checked
    for section, key, value in (
        (endpoint, "host", args.host),
        (endpoint, "port", args.port),
        (endpoint, "model_name", args.model_name),
        (endpoint, "renderer", args.renderer),
        (model, "device", args.device),
        (model, "dtype", args.dtype),
        (serve, "max_batch", args.max_batch),
        (serve, "record_dir", str(args.record) if args.record is not None else None),
    ):
        if value is not None:
            section[key] = value
    if endpoint.get("renderer"):
        from slipstream.run.runfile import check_renderer

        check_renderer(endpoint["renderer"])
    try:
        return StandaloneConfig(
            model=msgspec.convert(model, ModelSource),
            endpoint=msgspec.convert(endpoint, ServeConfig),
            serve=msgspec.convert(serve, StandaloneSection),
        )
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    try:
        cfg = resolve(args)
    except ValueError as exc:
        print(f"slipstream serve: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        from slipstream.runtime.config import dump

        print(dump(cfg))
        return 0
    import asyncio
    import signal

    from slipstream.serve.standalone import serve

    def ready(url: str, model_id: str) -> None:
        sys.stdout.write(f"serving {model_id} at {url}\n")
        sys.stdout.flush()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg, stop, ready)

    asyncio.run(main())
    return 0
