"""Named model sizes built from a config alone (no checkpoint), for the demo, tests and benchmarks.

- "tiny" (~1.05M parameters): what the CPU demo trains; small enough that a rollout worker and
  the learner share two cores and still learn the arithmetic task in minutes.
- "25m" (~25M parameters): the weight-sync benchmark's payload (about 50 MB in bf16).
- "micro" (~0.16M parameters, 2 layers of width 64): what the `lookup` tool-use demo trains. Its
  episodes are ~80 tokens, mostly fixed tool-call syntax, and what has to be learned is two
  copies (the key into the call, the result into the answer); this model learns them in ~500
  supervised steps at a quarter of the tiny model's step time (measured on a shared 2-core CPU:
  teacher-forced episode accuracy 0% at 300 steps, 91% at 600, 89 s), where "tiny" was at 0%
  after 500 steps and 384 s.
- "tiny-moe" (~3.4M parameters, ~1.05M active per token, as many as tiny has): "tiny" with each MLP replaced by a
  mixture of 8 SwiGLU experts of width 256, top-2 routing (slipstream.engine.moe), so a token's
  active feed-forward width (2 x 256) equals tiny's 512. What router replay is tested and
  measured on.

All use the ByteTokenizer's 259-id vocabulary, so no tokenizer files are involved.
"""

from __future__ import annotations

import torch

from slipstream.engine.config import ModelConfig
from slipstream.engine.model import CausalLM
from slipstream.engine.tokenizer import ByteTokenizer

_BYTES = ByteTokenizer()

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        model_type="llama",
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=_BYTES.vocab_size,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        bos_token_id=_BYTES.BOS,
        eos_token_id=_BYTES.EOS,
        pad_token_id=_BYTES.PAD,
    ),
    "micro": ModelConfig(
        model_type="llama",
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=_BYTES.vocab_size,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        bos_token_id=_BYTES.BOS,
        eos_token_id=_BYTES.EOS,
        pad_token_id=_BYTES.PAD,
    ),
    "tiny-moe": ModelConfig(
        model_type="llama",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=_BYTES.vocab_size,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        bos_token_id=_BYTES.BOS,
        eos_token_id=_BYTES.EOS,
        pad_token_id=_BYTES.PAD,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    "25m": ModelConfig(
        model_type="llama",
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=_BYTES.vocab_size,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        bos_token_id=_BYTES.BOS,
        eos_token_id=_BYTES.EOS,
        pad_token_id=_BYTES.PAD,
    ),
}


def build_tiny(
    preset: str | ModelConfig = "tiny",
    seed: int = 0,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[CausalLM, ByteTokenizer]:
    """A randomly initialised (seeded, reproducible) model for a preset name or an explicit config."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown model preset {preset!r} (known: {', '.join(sorted(PRESETS))})")
        cfg = PRESETS[preset]
    else:
        cfg = preset
    if cfg.vocab_size < _BYTES.vocab_size:
        raise ValueError(
            f"build_tiny needs vocab_size >= {_BYTES.vocab_size} for the ByteTokenizer, got {cfg.vocab_size}"
        )
    # Built on meta and initialised from a private generator: reproducible, and the global RNG
    # is left untouched (nn.Linear's own init would draw from it).
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.materialize("cpu", torch.float32)
    gen = torch.Generator().manual_seed(seed)
    model.init_weights(gen)
    return model.to(device=device, dtype=dtype), ByteTokenizer()
