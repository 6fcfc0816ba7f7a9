"""Slipstream engine: Llama/Qwen2 models in plain torch, tokenizers, and the inference engine.

The rollout worker and eval-gate depend on the `Engine` protocol (interface.py); `TorchEngine`
is its implementation here, a vLLM adapter can be another. Models load from and save to
Hugging Face directories, and their `state_dict` names are the weight-sync unit.

Names are imported lazily (PEP 562), so `import slipstream.engine.interface` or a config class
holding `slipstream.engine.source.ModelSource` does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "ModelConfig": "config",
    "EngineError": "driver",
    "TorchEngine": "engine",
    "Engine": "interface",
    "FinishReason": "interface",
    "GenerationRequest": "interface",
    "GenerationResult": "interface",
    "SamplingParams": "interface",
    "Timings": "interface",
    "KVCache": "kv_cache",
    "load_pretrained": "loading",
    "read_state_dict": "loading",
    "save_pretrained": "loading",
    "CausalLM": "model",
    "count_parameters": "model",
    "PRESETS": "presets",
    "build_tiny": "presets",
    "process_logits": "sampling",
    "sample": "sampling",
    "ByteTokenizer": "tokenizer",
    "HFTokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
}

__all__ = [
    "PRESETS",
    "ByteTokenizer",
    "CausalLM",
    "Engine",
    "EngineError",
    "FinishReason",
    "GenerationRequest",
    "GenerationResult",
    "HFTokenizer",
    "KVCache",
    "ModelConfig",
    "SamplingParams",
    "Timings",
    "Tokenizer",
    "TorchEngine",
    "build_tiny",
    "count_parameters",
    "load_pretrained",
    "load_tokenizer",
    "process_logits",
    "read_state_dict",
    "sample",
    "save_pretrained",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'slipstream.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"slipstream.engine.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from slipstream.engine.config import ModelConfig
    from slipstream.engine.driver import EngineError
    from slipstream.engine.engine import TorchEngine
    from slipstream.engine.interface import (
        Engine,
        FinishReason,
        GenerationRequest,
        GenerationResult,
        SamplingParams,
        Timings,
    )
    from slipstream.engine.kv_cache import KVCache
    from slipstream.engine.loading import load_pretrained, read_state_dict, save_pretrained
    from slipstream.engine.model import CausalLM, count_parameters
    from slipstream.engine.presets import PRESETS, build_tiny
    from slipstream.engine.sampling import process_logits, sample
    from slipstream.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
