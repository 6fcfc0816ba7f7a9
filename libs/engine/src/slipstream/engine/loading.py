"""Reading and writing Hugging Face model directories (config.json + safetensors + tokenizer).

`load_pretrained` accepts what `transformers.save_pretrained` writes: one `model.safetensors`
or shards listed in `model.safetensors.index.json`. The model is built on the meta device and
materialised once, so loading never pays for a random init. `save_pretrained` writes the same
layout back (sharded when asked), omitting `lm_head.weight` for tied embeddings as HF does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from slipstream.engine.config import ModelConfig
from slipstream.engine.model import CausalLM
from slipstream.engine.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype} (expected one of {', '.join(_DTYPES)})")


def _weight_files(directory: Path) -> list[Path]:
    if (directory / INDEX_FILE).is_file():
        index = json.loads((directory / INDEX_FILE).read_text())
        names = sorted(set(index.get("weight_map", {}).values()))
        if not names:
            raise ValueError(f"{directory / INDEX_FILE} has an empty weight_map")
        return [directory / n for n in names]
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {directory}")


def read_state_dict(directory: str | Path, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """Every tensor of a (possibly sharded) safetensors checkpoint, by name."""
    out: dict[str, Tensor] = {}
    for path in _weight_files(Path(directory)):
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint shard {path} is missing")
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                out[name] = f.get_tensor(name)
    return out


def load_pretrained(
    directory: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> tuple[CausalLM, ByteTokenizer | HFTokenizer]:
    """Model and tokenizer from an HF directory. `dtype=None` keeps the checkpoint's dtype."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {directory}")
    cfg = ModelConfig.from_hf(json.loads(config_path.read_text()))
    state = read_state_dict(directory, device)
    model = model_from_state_dict(cfg, state, dtype=dtype, device=device, source=str(directory))
    return model, load_tokenizer(directory)


def model_from_state_dict(
    cfg: ModelConfig,
    state: dict[str, Tensor],
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    source: str = "state dict",
) -> CausalLM:
    """Build a CausalLM for `cfg` holding exactly the tensors in `state` (names checked)."""
    if dtype is None:
        floats = [t.dtype for t in state.values() if t.is_floating_point()]
        dtype = floats[0] if floats else torch.float32
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.materialize(device, dtype)
    expected = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{source}: checkpoint does not match the config: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, target in expected.items():
            src = state[name]
            if tuple(src.shape) != tuple(target.shape):
                raise ValueError(
                    f"{source}: tensor {name} has shape {tuple(src.shape)}, config says {tuple(target.shape)}"
                )
            target.copy_(src)
    return model


def save_pretrained(
    model: CausalLM,
    tokenizer: ByteTokenizer | HFTokenizer | None,
    directory: str | Path,
    *,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write config.json, safetensors (sharded above `max_shard_bytes`) and the tokenizer files."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    dtype = next(iter(state.values())).dtype
    (directory / "config.json").write_text(json.dumps(cfg.to_hf(dtype_name(dtype)), indent=2) + "\n")
    meta = {"format": "pt"}
    total = sum(t.numel() * t.element_size() for t in state.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(state, str(directory / SINGLE_FILE), metadata=meta)
    else:
        shards: list[dict[str, Tensor]] = [{}]
        size = 0
        for name, t in state.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += nbytes
        weight_map: dict[str, str] = {}
        width = max(5, int(math.log10(len(shards))) + 1)
        for i, shard in enumerate(shards, start=1):
            fname = f"model-{i:0{width}d}-of-{len(shards):0{width}d}.safetensors"
            save_file(shard, str(directory / fname), metadata=meta)
            weight_map.update(dict.fromkeys(shard, fname))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(directory)
    return directory
