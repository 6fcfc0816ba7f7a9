"""MTP draft modules added to a model and self-distilled on its own samples (`slipstream mtp-distill`).

`run` loads the model (`load`: a named model, a local Hugging Face directory or a preset), draws
its prompts (`prompts_for`: the real-model demo's task through the chat template, else short
arithmetic questions), distils `--depth` modules (`slipstream.engine.mtp_distill`) and writes the
model with them. `slipstream bench engine` measures speculative decoding with the same two helpers.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any


def prompts_for(tok: Any, count: int, seed: int) -> list[list[int]]:
    """`count` prompts to sample a model on: the real-model demo's chat prompts where the tokenizer
    has a chat template, else short arithmetic questions (the byte-level presets)."""
    template = getattr(tok, "chat_template", None)
    if template is not None:
        from slipstream.envs.registry import get_env

        env = get_env("search_call")
        tasks = env.generate("train", count, seed=seed)
        return [tok.encode(template.render(env.chat_messages(t, t.prompt), add_generation_prompt=True)) for t in tasks]
    gen = random.Random(seed)
    return [tok.encode(f"{gen.randint(0, 99)}+{gen.randint(0, 99)}=") for _ in range(count)]


def load(name: str, dtype_name: str, device: str) -> tuple[Any, Any]:
    """Model and tokenizer from a preset name, a local HF directory or a catalog name."""
    import torch

    from slipstream.engine.catalog import ensure_model
    from slipstream.engine.loading import load_pretrained
    from slipstream.engine.presets import PRESETS, build_tiny

    dtype = getattr(torch, dtype_name)
    if name in PRESETS:
        return build_tiny(name, seed=0, dtype=dtype, device=device)
    local = Path(name)
    return load_pretrained(local if local.is_dir() else ensure_model(name), dtype=dtype, device=device)


def run(args: argparse.Namespace) -> int:
    import torch

    from slipstream.bench.main import write_json
    from slipstream.engine.loading import save_pretrained
    from slipstream.engine.mtp_distill import distill_on_own_samples

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load(args.model, args.dtype, args.device)
    report = distill_on_own_samples(
        model,
        tok,
        prompts_for(tok, args.prompts, seed=args.seed + 1),
        prompts_for(tok, args.held_out, seed=args.seed + 2),
        depth=args.depth,
        steps=args.steps,
        lr=args.lr,
        batch_size=args.batch,
        positions_per_step=args.positions,
        samples_per_prompt=args.samples,
        max_tokens=args.tokens,
        seed=args.seed,
    )
    out = save_pretrained(model, tok, args.out)
    report["model"] = args.model
    report["out"] = str(out)
    before = [round(x, 4) for x in report["held_out_kl_before"]]
    after = [round(x, 4) for x in report["held_out_kl_after"]]
    print(
        f"{args.model}: {report['depth']} MTP modules self-distilled {report['steps']} steps on "
        f"{report['corpus_sequences']} own samples ({report['distill_s']:.0f} s); held-out KL per depth "
        f"{before} -> {after}; wrote {out}"
    )
    write_json(report, args.json)
    return 0
