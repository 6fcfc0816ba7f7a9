"""The run's model, checked when a run file or the flags load: before anything starts.

A run trains either the tiny preset (no model named), a named pretrained model from the catalog
(`smollm2-135m`), or a local Hugging Face directory (`[model] path`, `--model PATH`). A wrong
name, a directory that is not a model, or a config.json this engine cannot reproduce would
otherwise surface seconds into a run, as a traceback from the warm-start or a service that dies
at setup. `check_model` answers as the loaders will: it reads config.json with the engine's own
`ModelConfig.from_hf` (the one-line `UnsupportedConfig` naming the field and what is supported)
and looks for the weights and the tokenizer, without importing torch or reading a tensor.
"""

from __future__ import annotations

import json
from pathlib import Path


class ModelNameError(ValueError):
    """A model name or directory that cannot be trained; the message says what exists."""


def check_model(value: str, *, base: Path | None = None, named: bool = False) -> str:
    """The model `value` names, checked: a catalog name as is, a directory as an absolute path
    (a relative one is taken from `base`, default the working directory); '' (the preset) as is.
    With `named` only a catalog name will do (`[model] name`; a directory goes in `[model] path`).

    Raises `ModelNameError` naming `value` and listing the named models."""
    from slipstream.engine.catalog import CATALOG, check_available

    if named and value and value not in CATALOG:
        raise ModelNameError(
            f"unknown model name {value!r} (known: {', '.join(CATALOG)}; a local directory goes in [model] path)"
        )
    if not value or value in CATALOG:
        if value:
            try:
                check_available(value)
            except FileNotFoundError as exc:
                raise ModelNameError(str(exc)) from None
        return value
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = (base or Path.cwd()) / path
    if not path.is_dir():
        raise ModelNameError(
            f"unknown model {value!r}: not a named model (known: {', '.join(CATALOG)}) "
            f"and not a directory{f' ({path})' if str(path) != value else ''}"
        )
    check_model_dir(path)
    return str(path.resolve())


def check_model_dir(path: Path) -> None:
    """`path` holds what `load_pretrained` reads: a supported config.json, weights, a tokenizer."""
    from slipstream.engine.config import ModelConfig

    config = path / "config.json"
    if not config.is_file():
        raise ModelNameError(f"model directory {path} has no config.json (a Hugging Face model directory needs one)")
    try:
        raw = json.loads(config.read_text())
    except ValueError as exc:
        raise ModelNameError(f"{config} is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelNameError(f"{config} is not a JSON object")
    try:
        ModelConfig.from_hf(raw)
    except ValueError as exc:
        raise ModelNameError(f"model directory {path}: {exc}") from None
    if not (path / "model.safetensors").is_file() and not (path / "model.safetensors.index.json").is_file():
        raise ModelNameError(f"model directory {path} has no model.safetensors or model.safetensors.index.json")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise ModelNameError(f"model directory {path} has no tokenizer.json")
