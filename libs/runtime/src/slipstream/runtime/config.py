"""Typed configuration: defaults -> TOML file -> SLIPSTREAM_<SECTION>__<FIELD> env -> CLI flags.

A service's config is a msgspec Struct whose fields are sections (Structs owned by the lib that
uses them: `bus`, `store`, `telemetry`, ...) plus the service's own section. Every field has a
default and a description (`Annotated[..., msgspec.Meta(description=...)]`). Unknown keys are
errors at every layer, with the offending key named. This is the only module that reads
`os.environ` for configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec

ENV_PREFIX = "SLIPSTREAM_"
C = TypeVar("C", bound=msgspec.Struct)


class ConfigError(ValueError):
    """Configuration that cannot be accepted; the message names the key and the layer."""


def _sections(cls: type[msgspec.Struct]) -> dict[str, type[msgspec.Struct]]:
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    out: dict[str, type[msgspec.Struct]] = {}
    for f in info.fields:
        if not isinstance(f.type, msgspec.inspect.StructType):
            raise TypeError(f"{cls.__name__}.{f.name}: top-level config fields must be section Structs")
        out[f.name] = f.type.cls
    return out


def _fields(section: type[msgspec.Struct]) -> dict[str, msgspec.inspect.Field]:
    info = msgspec.inspect.type_info(section)
    assert isinstance(info, msgspec.inspect.StructType)
    return {f.name: f for f in info.fields}


def field_doc(section: type[msgspec.Struct], name: str) -> str:
    """The one-line description of a config field (from its msgspec.Meta)."""
    schema = msgspec.json.schema(section)
    defs = schema.get("$defs", {})
    node = defs.get(section.__name__, schema)
    return str(node.get("properties", {}).get(name, {}).get("description", ""))


def _parse_scalar(raw: str) -> Any:
    """CLI/env values are strings; JSON syntax is accepted for lists, dicts, numbers and bools."""
    s = raw.strip()
    if s[:1] in "[{" or s in ("true", "false", "null"):
        try:
            return json.loads(s)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"value {raw!r} looks like JSON but does not parse: {exc}") from exc
    return raw


def _set(tree: dict[str, Any], section: str, field: str, value: Any) -> None:
    tree.setdefault(section, {})[field] = value


def _check_known(cls: type[msgspec.Struct], tree: Mapping[str, Any], where: str) -> None:
    sections = _sections(cls)
    for sec, body in tree.items():
        if sec not in sections:
            raise ConfigError(f"{where}: unknown section {sec!r}; known sections: {sorted(sections)}")
        if not isinstance(body, Mapping):
            raise ConfigError(f"{where}: section {sec!r} must be a table, got {type(body).__name__}")
        fields = _fields(sections[sec])
        for key in body:
            if key not in fields:
                raise ConfigError(f"{where}: unknown key {sec}.{key}; known keys in [{sec}]: {sorted(fields)}")


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for sec, body in over.items():
        out.setdefault(sec, {}).update(body)
    return out


def env_layer(cls: type[msgspec.Struct], environ: Mapping[str, str]) -> dict[str, Any]:
    """SLIPSTREAM_<SECTION>__<FIELD>=value pairs. Unknown SLIPSTREAM_* names with '__' are errors."""
    tree: dict[str, Any] = {}
    sections = _sections(cls)
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        sec, _, field = name[len(ENV_PREFIX) :].lower().partition("__")
        if sec not in sections:
            # Another service's section (a shared env file) is not this service's error.
            continue
        if field not in _fields(sections[sec]):
            raise ConfigError(f"environment: {name} names unknown key {sec}.{field}")
        _set(tree, sec, field, _parse_scalar(raw))
    return tree


def toml_layer(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {p} is not valid TOML: {exc}") from exc


def build(cls: type[C], tree: Mapping[str, Any], where: str = "config") -> C:
    _check_known(cls, tree, where)
    try:
        return msgspec.convert(dict(tree), cls, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def add_arguments(parser: argparse.ArgumentParser, cls: type[msgspec.Struct]) -> None:
    """One `--section.field` flag per config field, documented from the field's description."""
    parser.add_argument("--config", metavar="FILE", help="TOML config file (overrides defaults).")
    parser.add_argument("--print-config", action="store_true", help="Print the resolved config as TOML-ish JSON and exit.")
    for sec, section in _sections(cls).items():
        group = parser.add_argument_group(f"[{sec}]")
        defaults = section()
        for name in _fields(section):
            flag = f"--{sec}.{name.replace('_', '-')}"
            default = getattr(defaults, name)
            group.add_argument(
                flag,
                dest=f"cfg__{sec}__{name}",
                metavar="V",
                default=None,
                help=f"{field_doc(section, name)} (default: {default!r}; env {ENV_PREFIX}{sec.upper()}__{name.upper()})",
            )


def resolve(
    cls: type[C],
    args: argparse.Namespace | None = None,
    *,
    config_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> C:
    """Resolve a config in the documented precedence order."""
    tree: dict[str, Any] = {}
    path = config_file or (getattr(args, "config", None) if args is not None else None)
    if path:
        layer = toml_layer(path)
        _check_known(cls, layer, f"config file {path}")
        tree = _merge(tree, layer)
    env = env_layer(cls, os.environ if environ is None else environ)
    tree = _merge(tree, env)
    if args is not None:
        cli: dict[str, Any] = {}
        for key, value in vars(args).items():
            if key.startswith("cfg__") and value is not None:
                _, sec, field = key.split("__", 2)
                _set(cli, sec, field, _parse_scalar(value))
        tree = _merge(tree, cli)
    if overrides:
        _check_known(cls, overrides, "overrides")
        tree = _merge(tree, overrides)
    return build(cls, tree)


def to_dict(cfg: msgspec.Struct) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)


def dump(cfg: msgspec.Struct) -> str:
    return msgspec.json.format(msgspec.json.encode(cfg).decode(), indent=2)


def parse_cli(
    cls: type[C], argv: Sequence[str] | None = None, *, prog: str | None = None, description: str = ""
) -> C:
    """Parse argv into a config; `--print-config` prints it and exits. Errors exit 2 with the reason."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser, cls)
    args = parser.parse_args(argv)
    try:
        cfg = resolve(cls, args)
    except ConfigError as exc:
        parser.exit(2, f"{parser.prog}: config error: {exc}\n")
    if args.print_config:
        sys.stdout.write(dump(cfg) + "\n")
        sys.exit(0)
    return cfg
