"""The decoder's architecture description, read from and written to a Hugging Face config.json.

One struct covers the Llama, Qwen2, Qwen3 and Mistral families: all are pre-norm decoders with
RMSNorm, RoPE, grouped-query attention and a SwiGLU MLP. They differ in which projections carry a
bias, in Qwen3's per-head RMSNorm of queries and keys (`qk_norm`), in Mistral's sliding-window
attention (`sliding_window`) and in Llama 3.x's rescaled RoPE frequencies (`rope_scaling`).
Anything this engine cannot reproduce exactly (another activation, another rope type, Qwen's
per-layer windows) is rejected when the config is read with a one-line `UnsupportedConfig` that
names the field, its value and what is supported, so a checkpoint never loads into a silently
different model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec

Doc = msgspec.Meta

ModelType = Literal["llama", "qwen2", "qwen3", "mistral"]

_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_ARCHITECTURES)
ROPE_TYPES: tuple[str, ...] = ("default", "llama3")


class UnsupportedConfig(ValueError):
    """A config.json this engine cannot reproduce exactly; the message names the field and value."""


class RopeScaling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Llama 3.x's `llama3` RoPE: long wavelengths slowed by `factor`, a smooth band in between."""

    factor: Annotated[float, Doc(description="Divisor of the low frequencies (8 for Llama 3.1).")]
    low_freq_factor: Annotated[float, Doc(description="Wavelengths past original/low_freq_factor are divided.")]
    high_freq_factor: Annotated[float, Doc(description="Wavelengths under original/high_freq_factor are kept.")]
    original_max_position_embeddings: Annotated[int, Doc(description="Context length of pretraining.")]
    rope_type: Annotated[Literal["llama3"], Doc(description="Only 'llama3' is implemented.")] = "llama3"


class ModelConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Shape and numerics of a Llama/Qwen2/Qwen3/Mistral decoder, in Hugging Face's field names."""

    model_type: Annotated[
        ModelType, Doc(description="'llama', 'qwen2', 'qwen3' or 'mistral' (decides the HF architecture name).")
    ]
    hidden_size: Annotated[int, Doc(description="Width of the residual stream.")]
    intermediate_size: Annotated[int, Doc(description="Width of the SwiGLU MLP.")]
    num_hidden_layers: Annotated[int, Doc(description="Number of decoder layers.")]
    num_attention_heads: Annotated[int, Doc(description="Query heads per layer.")]
    num_key_value_heads: Annotated[int, Doc(description="Key/value heads per layer (grouped-query attention).")]
    vocab_size: Annotated[int, Doc(description="Rows of the embedding and of lm_head.")]
    max_position_embeddings: Annotated[int, Doc(description="Longest sequence the model was built for.")] = 2048
    rms_norm_eps: Annotated[float, Doc(description="Epsilon inside RMSNorm.")] = 1e-6
    rope_theta: Annotated[float, Doc(description="RoPE base frequency.")] = 10000.0
    tie_word_embeddings: Annotated[bool, Doc(description="lm_head shares the embedding matrix.")] = False
    attention_bias: Annotated[bool, Doc(description="q/k/v projections carry a bias (always on for qwen2).")] = False
    o_proj_bias: Annotated[bool, Doc(description="o_proj carries a bias (llama ties it to attention_bias).")] = False
    head_dim: Annotated[int, Doc(description="Per-head width; 0 means hidden_size / num_attention_heads.")] = 0
    bos_token_id: Annotated[int | None, Doc(description="Beginning-of-sequence id, if the model uses one.")] = None
    eos_token_id: Annotated[int | None, Doc(description="End-of-sequence id.")] = None
    pad_token_id: Annotated[int | None, Doc(description="Padding id.")] = None
    num_experts: Annotated[
        int, Doc(description="Experts per MoE layer (slipstream.engine.moe); 0 = a dense SwiGLU MLP, at most 256.")
    ] = 0
    num_experts_per_tok: Annotated[int, Doc(description="Experts each token is routed to (top-k), MoE only.")] = 2
    mtp_depth: Annotated[
        int,
        Doc(description="Multi-token-prediction modules (mtp.py): how many tokens past the next one the model drafts."),
    ] = 0
    rope_scaling: Annotated[
        RopeScaling | None, Doc(description="Llama 3.x `llama3` frequency scaling; None = plain RoPE.")
    ] = None
    qk_norm: Annotated[bool, Doc(description="RMSNorm over each head of q and k before RoPE (qwen3).")] = False
    sliding_window: Annotated[
        int, Doc(description="Each query sees only the last N positions, itself included (mistral); 0 = off.")
    ] = 0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_key_value_heads <= 0 or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim == 0 and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"ModelConfig.hidden_size ({self.hidden_size}) is not divisible by "
                f"num_attention_heads ({self.num_attention_heads}); set head_dim"
            )
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts <= 256:
            raise ValueError(
                f"ModelConfig MoE needs 1 <= num_experts_per_tok ({self.num_experts_per_tok}) <= num_experts "
                f"({self.num_experts}) <= 256"
            )
        if self.mtp_depth < 0:
            raise ValueError(f"ModelConfig.mtp_depth must be >= 0, got {self.mtp_depth}")
        if self.dim_per_head % 2:
            raise ValueError(f"ModelConfig head_dim must be even for RoPE, got {self.dim_per_head}")
        if self.sliding_window < 0:
            raise ValueError(f"ModelConfig.sliding_window must be >= 0, got {self.sliding_window}")

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def architecture(self) -> str:
        return _ARCHITECTURES[self.model_type]

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> ModelConfig:
        """Read an HF config.json dict (transformers 4.x `rope_theta` or 5.x `rope_parameters`)."""
        model_type = raw.get("model_type")
        if model_type not in _ARCHITECTURES:
            raise UnsupportedConfig(
                f"config.json model_type {model_type!r} is not supported (supported: {', '.join(_ARCHITECTURES)})"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedConfig(f"config.json hidden_act {act!r} is not supported (supported: silu)")
        if raw.get("mlp_bias"):
            raise UnsupportedConfig("config.json mlp_bias=true is not supported (supported: false)")
        if model_type in ("qwen2", "qwen3") and raw.get("use_sliding_window"):
            raise UnsupportedConfig(
                f"config.json use_sliding_window=true is not supported for {model_type} (supported: false; "
                "sliding windows are implemented for mistral)"
            )
        layer_types = set(raw.get("layer_types") or ())
        if model_type != "mistral" and layer_types - {"full_attention"}:
            raise UnsupportedConfig(
                f"config.json layer_types {sorted(layer_types)} is not supported (supported: full_attention)"
            )
        rope_theta, rope_scaling = _rope(raw)
        sliding = int(raw.get("sliding_window") or 0) if model_type == "mistral" else 0
        missing = [
            k
            for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
            if k not in raw
        ]
        if missing:
            raise ValueError(f"config.json lacks required fields: {', '.join(missing)}")
        if model_type == "qwen2":
            # Qwen2 hard-codes bias on q/k/v and none on o_proj; its config has no switch for it.
            qkv_bias, o_bias = True, False
        elif model_type == "mistral":
            qkv_bias = o_bias = False  # Mistral has no bias switch and no biases
        else:
            qkv_bias = o_bias = bool(raw.get("attention_bias", False))
        heads = int(raw["num_attention_heads"])
        head_dim = raw.get("head_dim") or 0
        if head_dim and int(head_dim) == int(raw["hidden_size"]) // heads:
            head_dim = 0
        return cls(
            model_type=model_type,
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            vocab_size=int(raw["vocab_size"]),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            head_dim=int(head_dim),
            bos_token_id=_first_id(raw.get("bos_token_id")),
            eos_token_id=_first_id(raw.get("eos_token_id")),
            pad_token_id=_first_id(raw.get("pad_token_id")),
            num_experts=int(raw.get("num_experts") or 0),
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 2),
            mtp_depth=int(raw.get("mtp_depth", 0)),
            rope_scaling=rope_scaling,
            qk_norm=model_type == "qwen3",
            sliding_window=sliding,
        )

    def to_hf(self, dtype_name: str = "float32") -> dict[str, Any]:
        """An HF config.json dict that transformers 4.x and 5.x both load into the same model."""
        if self.model_type == "qwen2" and (not self.attention_bias or self.o_proj_bias):
            raise ValueError("a qwen2 config must have attention_bias=True and o_proj_bias=False")
        if self.model_type in ("llama", "qwen3") and self.attention_bias != self.o_proj_bias:
            raise ValueError(f"a {self.model_type} config must have o_proj_bias equal to attention_bias")
        if self.model_type == "mistral" and (self.attention_bias or self.o_proj_bias):
            raise ValueError("a mistral config has no projection biases")
        if self.qk_norm != (self.model_type == "qwen3"):
            raise ValueError(f"qk_norm={self.qk_norm} does not match model_type {self.model_type!r} (qwen3 only)")
        if self.sliding_window and self.model_type != "mistral":
            raise ValueError(f"sliding_window is written for mistral only, not {self.model_type!r}")
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {**msgspec.structs.asdict(self.rope_scaling), "rope_theta": self.rope_theta}
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.dim_per_head,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": dtype_name,
            "dtype": dtype_name,
        }
        if self.num_experts:
            # Slipstream's own MoE layout (moe.py): its loader reads these back; transformers has no
            # llama with experts, so such a directory is for Slipstream's processes only.
            out["num_experts"] = self.num_experts
            out["num_experts_per_tok"] = self.num_experts_per_tok
        if self.mtp_depth:
            out["mtp_depth"] = self.mtp_depth  # Slipstream's own key; transformers ignores it
        if self.rope_scaling is not None:
            out["rope_scaling"] = rope  # transformers 4.x reads the scaling from here
        if self.model_type == "llama":
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = False
        elif self.model_type == "qwen3":
            out["attention_bias"] = self.attention_bias
            out["use_sliding_window"] = False
        elif self.model_type == "mistral":
            out["sliding_window"] = self.sliding_window or None
        else:
            out["use_sliding_window"] = False
        return out


def _rope(raw: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from transformers 4.x `rope_theta` + `rope_scaling` or 5.x `rope_parameters`."""
    rope_theta = float(raw.get("rope_theta", 10000.0))
    rope = raw.get("rope_parameters") or raw.get("rope_scaling")
    if not rope:
        return rope_theta, None
    if not isinstance(rope, Mapping):
        raise UnsupportedConfig(f"config.json rope_parameters {rope!r} is not a table")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedConfig(
            f"config.json rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    rope_theta = float(rope.get("rope_theta", rope_theta))
    if rope_type == "default":
        return rope_theta, None
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in fields if k not in rope]
    if missing:
        raise UnsupportedConfig(f"config.json llama3 rope scaling lacks {', '.join(missing)}")
    return rope_theta, RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )


def _first_id(value: object) -> int | None:
    # Some configs list several eos ids; the first is the canonical one.
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)  # type: ignore[call-overload]
