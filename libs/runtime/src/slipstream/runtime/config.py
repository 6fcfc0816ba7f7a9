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
import re
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
        t = f.type.type if isinstance(f.type, msgspec.inspect.Metadata) else f.type
        if not isinstance(t, msgspec.inspect.StructType):
            raise TypeError(f"{cls.__name__}.{f.name}: top-level config fields must be section Structs")
        out[f.name] = t.cls
    return out


def _section_docs(cls: type[msgspec.Struct]) -> dict[str, str]:
    """Descriptions of the sections themselves (`Annotated[Section, Meta(description=...)]`).

    A class's `section_docs` mapping (`slipstream.runtime.base.ServiceConfig`) overrides them: a
    service saying what it keeps in a shared section.
    """
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    docs = {
        f.name: str((f.type.extra_json_schema or {}).get("description", ""))
        for f in info.fields
        if isinstance(f.type, msgspec.inspect.Metadata)
    }
    return {**docs, **getattr(cls, "section_docs", {})}


def _fields(section: type[msgspec.Struct]) -> dict[str, msgspec.inspect.Field]:
    info = msgspec.inspect.type_info(section)
    assert isinstance(info, msgspec.inspect.StructType)
    return {f.name: f for f in info.fields}


def _descriptions(section: type[msgspec.Struct]) -> dict[str, str]:
    schema = msgspec.json.schema(section)
    node = schema.get("$defs", {}).get(section.__name__, schema)
    return {name: str(prop.get("description", "")) for name, prop in node.get("properties", {}).items()}


def field_doc(section: type[msgspec.Struct], name: str) -> str:
    """The one-line description of a config field (from its msgspec.Meta)."""
    return _descriptions(section).get(name, "")


def env_name(section: str, field: str) -> str:
    """The environment variable that sets `[section].field`."""
    return f"{ENV_PREFIX}{section.upper()}__{field.upper()}"


def _parse_scalar(raw: str) -> Any:
    """CLI/env values are strings; JSON syntax is accepted for lists, dicts, numbers and bools."""
    s = raw.strip()
    # `"" in "[{"` is True: test the first character only when there is one, so an empty value
    # stays the empty string (e.g. SLIPSTREAM_LEARNER__AUTOCAST="" for "no autocast").
    if (s and s[0] in "[{") or s in ("true", "false", "null"):
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
    """SLIPSTREAM_<SECTION>__<FIELD>=value pairs.

    An unknown field of a known section is an error; a section this config does not have is
    skipped, because one env file or ConfigMap is often shared by several services.
    """
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
    """One `--section.field-name` flag per config field, documented from the field's description."""
    parser.add_argument("--config", metavar="FILE", help="TOML config file (overrides defaults).")
    parser.add_argument("--print-config", action="store_true", help="Print the resolved config as JSON and exit.")
    section_docs = _section_docs(cls)
    for sec, section in _sections(cls).items():
        group = parser.add_argument_group(f"[{sec}]", section_docs.get(sec) or None)
        defaults = section()
        docs = _descriptions(section)
        for name in _fields(section):
            default = getattr(defaults, name)
            group.add_argument(
                f"--{sec}.{name.replace('_', '-')}",
                dest=f"cfg__{sec}__{name}",
                metavar="V",
                default=None,
                help=f"{docs.get(name, '')} (default: {default!r}; env {env_name(sec, name)})",
            )


def build_parser(
    cls: type[msgspec.Struct], *, prog: str | None = None, description: str = ""
) -> argparse.ArgumentParser:
    # No abbreviations: `--bus.u` silently meaning `--bus.url` hides typos.
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        allow_abbrev=False,
        # The full list of flags is below, grouped by section; the usage line would repeat it.
        usage="%(prog)s [-h] [--config FILE] [--print-config] [--<section>.<field> V ...]",
        epilog=f"Precedence: defaults < --config TOML < {ENV_PREFIX}<SECTION>__<FIELD> env < flags. "
        "Flags take dashes or underscores; lists and tables are JSON.",
    )
    add_arguments(parser, cls)
    return parser


def _unknown_flag(cls: type[msgspec.Struct], arg: str) -> str:
    if not arg.startswith("--"):
        return f"command line: unexpected argument {arg!r}"
    flag = arg[2:].split("=", 1)[0]
    sec, dot, field = flag.partition(".")
    sections = _sections(cls)
    if not dot:
        return f"command line: unknown option --{flag}"
    if sec not in sections:
        return f"command line: --{flag} names unknown section {sec!r}; known sections: {sorted(sections)}"
    known = sorted(_fields(sections[sec]))
    return f"command line: --{flag} names unknown key {sec}.{field.replace('-', '_')}; known keys in [{sec}]: {known}"


def _dashed(arg: str) -> str:
    """`--bus.fetch_batch=8` -> `--bus.fetch-batch=8`: flags may be spelled like the TOML keys."""
    if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
        return arg
    flag, eq, value = arg.partition("=")
    return flag.replace("_", "-") + eq + value


def parse_args(
    cls: type[msgspec.Struct], argv: Sequence[str] | None = None, *, parser: argparse.ArgumentParser | None = None
) -> argparse.Namespace:
    """argv -> argparse namespace; an unknown `--section.key` raises ConfigError naming it."""
    parser = parser or build_parser(cls)
    args, unknown = parser.parse_known_args([_dashed(a) for a in (sys.argv[1:] if argv is None else argv)])
    if unknown:
        raise ConfigError(_unknown_flag(cls, unknown[0]))
    return args


def _origin_of(exc: msgspec.ValidationError, origins: Mapping[tuple[str, str], str]) -> str:
    """Which layer set the value a validation error points at (`... - at `$.bus.fetch_batch``)."""
    m = re.search(r"at `\$\.(\w+)\.(\w+)", str(exc))
    if m is None:
        return ""
    layer = origins.get((m.group(1), m.group(2)))
    return f" ({m.group(1)}.{m.group(2)} set by {layer})" if layer else ""


def resolve(
    cls: type[C],
    args: argparse.Namespace | None = None,
    *,
    config_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> C:
    """Resolve a config in the documented precedence order: defaults, TOML, env, CLI, overrides."""
    layers: list[tuple[str, Mapping[str, Any]]] = []
    path = config_file or (getattr(args, "config", None) if args is not None else None)
    if path:
        layer = toml_layer(path)
        _check_known(cls, layer, f"config file {path}")
        layers.append((f"config file {path}", layer))
    layers.append(("environment", env_layer(cls, os.environ if environ is None else environ)))
    if args is not None:
        cli: dict[str, Any] = {}
        for key, value in vars(args).items():
            if key.startswith("cfg__") and value is not None:
                _, sec, field = key.split("__", 2)
                _set(cli, sec, field, _parse_scalar(value))
        layers.append(("command line", cli))
    if overrides:
        _check_known(cls, overrides, "overrides")
        layers.append(("overrides", overrides))
    tree: dict[str, Any] = {}
    origins: dict[tuple[str, str], str] = {}
    for where, values in layers:
        tree = _merge(tree, values)
        origins.update({(sec, key): where for sec, body in values.items() for key in body})
    _check_known(cls, tree, "config")
    try:
        return msgspec.convert(tree, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"config: {exc}{_origin_of(exc, origins)}") from exc


def to_dict(cfg: msgspec.Struct) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)


SECRET = "***"
_URL_PASSWORD = re.compile(r"^([a-z][a-z0-9+.-]*://[^:/@\s]*):[^@/\s]+@", re.IGNORECASE)


def redacted(tree: Any) -> Any:
    """`tree` with every `password` field and every password inside a URL replaced by ***."""
    if isinstance(tree, dict):
        return {
            k: (SECRET if v and (k == "password" or k.endswith("_password")) else redacted(v)) for k, v in tree.items()
        }
    if isinstance(tree, list):
        return [redacted(v) for v in tree]
    if isinstance(tree, str):
        return _URL_PASSWORD.sub(rf"\1:{SECRET}@", tree)
    return tree


def dump(cfg: msgspec.Struct) -> str:
    """The config as JSON for people (`--print-config`): passwords are never printed."""
    return msgspec.json.format(msgspec.json.encode(redacted(msgspec.to_builtins(cfg))).decode(), indent=2)


def parse_cli(cls: type[C], argv: Sequence[str] | None = None, *, prog: str | None = None, description: str = "") -> C:
    """Parse argv into a config; `--print-config` prints it and exits. Errors exit 2 with the reason."""
    parser = build_parser(cls, prog=prog, description=description)
    try:
        args = parse_args(cls, argv, parser=parser)
        cfg = resolve(cls, args)
    except ConfigError as exc:
        parser.exit(2, f"{parser.prog}: config error: {exc}\n")
    if args.print_config:
        sys.stdout.write(dump(cfg) + "\n")
        sys.exit(0)
    return cfg
