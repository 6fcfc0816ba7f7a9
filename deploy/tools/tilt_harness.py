"""Evaluate the Tiltfile offline: a Starlark interpreter with Tilt's builtins stubbed.

Why: Tilt is not installable on the project's CI and dev machines, yet the Tiltfile must keep
working. starlark-pyo3 (starlark-rust) runs it with every Tilt builtin it uses replaced by a
recorder whose Python signature follows Tilt's API (tilt-dev/tilt.build `api/api/__init__.py`), so
a misspelled keyword or a missing argument fails the evaluation the way Tilt would. The result
lists every call with its arguments bound to names, for tests to assert on.

Usage: python deploy/tools/tilt_harness.py [Tiltfile] [-- tilt args...]   (prints the calls as JSON)
"""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import starlark as sl

Value = Any


class TiltfileError(RuntimeError):
    """The Tiltfile failed to evaluate (Starlark error, bad builtin call, fail(), bad flag)."""


@dataclass
class Call:
    """One builtin call; `args` holds every parameter (defaults included) by name."""

    name: str
    args: dict[str, Value]


@dataclass
class TiltRun:
    """What one evaluation declared."""

    calls: list[Call] = field(default_factory=list)
    flags: dict[str, Value] = field(default_factory=dict)
    enabled: list[str] | None = None

    def of(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]

    @property
    def resources(self) -> list[str]:
        """Names of the resources configured with k8s_resource or local_resource."""
        out = [c.args["workload"] for c in self.of("k8s_resource")]
        out += [c.args["name"] for c in self.of("local_resource")]
        return out

    @property
    def images(self) -> dict[str, Call]:
        """Image ref -> the build that makes it."""
        return {c.args["ref"]: c for c in self.calls if c.name == "docker_build"}


class _Tilt:
    """The stubbed builtins of one evaluation; each records itself and returns a marker value."""

    def __init__(self, argv: Sequence[str], environ: Mapping[str, str], base: Path) -> None:
        self.base = base  # Tilt resolves relative paths against the Tiltfile's directory
        self.run = TiltRun()
        self.argv = list(argv)
        self.environ = dict(environ)
        self.defined: dict[str, tuple[str, bool]] = {}

    def recorder(self, name: str, fn: Callable[..., Value]) -> Callable[..., Value]:
        sig = inspect.signature(fn)

        def call(*args: Value, **kwargs: Value) -> Value:
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError as exc:
                raise TiltfileError(f"{name}(): {exc}") from None
            bound.apply_defaults()
            self.run.calls.append(Call(name, dict(bound.arguments)))
            return fn(*bound.args, **bound.kwargs)

        return call

    # ---- config.* and os.* (module-style builtins, exposed through a struct prelude)

    def _define(self, kind: str) -> Callable[..., None]:
        def define(name: str, args: bool = False, usage: str = "") -> None:
            self.defined[name] = (kind, args)

        return define

    def parse(self) -> dict[str, Value]:
        out: dict[str, Value] = {}
        positional = [n for n, (_, takes_args) in self.defined.items() if takes_args]
        it = iter(self.argv)
        for token in it:
            if not token.startswith("--"):
                if not positional:
                    raise TiltfileError(f"config.parse(): positional argument {token!r} but no setting takes args")
                out.setdefault(positional[0], []).append(token)
                continue
            key, eq, value = token[2:].partition("=")
            if key not in self.defined:
                raise TiltfileError(f"config.parse(): unknown flag --{key}; defined: {sorted(self.defined)}")
            kind, _ = self.defined[key]
            if kind == "bool":
                out[key] = value.lower() != "false" if eq else True
                continue
            if not eq:
                following = next(it, None)
                if following is None:
                    raise TiltfileError(f"config.parse(): --{key} needs a value")
                value = following
            if kind == "string_list":
                out.setdefault(key, []).append(value)
            else:
                out[key] = value
        self.run.flags = out
        return out

    def set_enabled_resources(self, resources: list[str]) -> None:
        self.run.enabled = list(resources)

    def getenv(self, key: str, default: Value = None) -> Value:
        return self.environ.get(key, default)

    def listdir(self, directory: str, recursive: bool = False) -> list[str]:
        """Tilt's listdir: absolute paths of the files (not directories) under `directory`."""
        root = (self.base / directory).resolve()
        if not root.is_dir():
            raise TiltfileError(f"listdir({directory!r}): not a directory")
        found = root.rglob("*") if recursive else root.iterdir()
        return sorted(str(p) for p in found if p.is_file())


def _marker(kind: str) -> Callable[..., dict[str, Value]]:
    def make(**kwargs: Value) -> dict[str, Value]:
        return {"__tilt__": kind, **kwargs}

    return make


# Stubs with Tilt's parameter names (the subset this repository uses, plus common neighbours).
def docker_build(
    ref: str,
    context: str,
    build_args: Value = None,
    dockerfile: str = "Dockerfile",
    dockerfile_contents: str = "",
    live_update: Value = None,
    match_in_env_vars: bool = False,
    ignore: Value = None,
    only: Value = None,
    entrypoint: Value = None,
    target: str = "",
    ssh: Value = None,
    network: str = "",
    secret: Value = None,
    extra_tag: Value = None,
    container_args: Value = None,
    cache_from: Value = None,
    pull: bool = False,
    platform: str = "",
    extra_hosts: Value = None,
) -> None:
    return None


def read_file(file_path: str, default: Value = None) -> str:
    """Tilt's read_file (a Blob there; str() of it is the text), relative to the repository root."""
    path = Path(__file__).resolve().parents[2] / file_path
    if not path.exists() and default is not None:
        return str(default)
    return path.read_text()


def k8s_yaml(yaml: Value, allow_duplicates: bool = False) -> None:
    return None


def kustomize(pathToDir: str, kustomize_bin: Value = None, flags: Value = None) -> dict[str, Value]:
    return _marker("kustomize")(path=pathToDir)


def k8s_resource(
    workload: str = "",
    new_name: str = "",
    port_forwards: Value = None,
    extra_pod_selectors: Value = None,
    trigger_mode: Value = None,
    resource_deps: Value = None,
    objects: Value = None,
    auto_init: bool = True,
    pod_readiness: str = "",
    links: Value = None,
    labels: Value = None,
    discovery_strategy: str = "",
) -> None:
    return None


def local_resource(
    name: str,
    cmd: Value = "",
    deps: Value = None,
    trigger_mode: Value = None,
    resource_deps: Value = None,
    ignore: Value = None,
    auto_init: bool = True,
    serve_cmd: Value = "",
    cmd_bat: Value = "",
    serve_cmd_bat: Value = "",
    allow_parallel: bool = False,
    links: Value = None,
    tags: Value = None,
    env: Value = None,
    serve_env: Value = None,
    readiness_probe: Value = None,
    dir: str = "",
    serve_dir: str = "",
    labels: Value = None,
) -> None:
    return None


def port_forward(local_port: int, container_port: Value = None, name: str = "", link_path: str = "", host: str = ""):
    return _marker("port_forward")(local_port=local_port, container_port=container_port, name=name)


def sync(local_path: str, remote_path: str) -> dict[str, Value]:
    return _marker("sync")(local_path=local_path, remote_path=remote_path)


def run(cmd: Value, trigger: Value = None, echo_off: bool = False) -> dict[str, Value]:
    return _marker("run")(cmd=cmd, trigger=list(trigger or []))


def fall_back_on(files: Value) -> dict[str, Value]:
    return _marker("fall_back_on")(files=[files] if isinstance(files, str) else list(files))


def probe(
    initial_delay_secs: int = 0,
    timeout_secs: int = 1,
    period_secs: int = 10,
    success_threshold: int = 1,
    failure_threshold: int = 3,
    exec: Value = None,
    http_get: Value = None,
    tcp_socket: Value = None,
) -> dict[str, Value]:
    return _marker("probe")(period_secs=period_secs, exec=exec, http_get=http_get, tcp_socket=tcp_socket)


def http_get_action(port: int, host: str = "", scheme: str = "http", path: str = "") -> dict[str, Value]:
    return _marker("http_get_action")(port=port, host=host, scheme=scheme, path=path)


def exec_action(command: Value) -> dict[str, Value]:
    return _marker("exec_action")(command=list(command))


def tcp_socket_action(port: int, host: str = "") -> dict[str, Value]:
    return _marker("tcp_socket_action")(port=port, host=host)


def update_settings(
    max_parallel_updates: int = 3, k8s_upsert_timeout_secs: int = 30, suppress_unused_image_warnings: Value = None
) -> None:
    return None


TOP_LEVEL = (
    read_file,
    docker_build,
    k8s_yaml,
    kustomize,
    k8s_resource,
    local_resource,
    port_forward,
    sync,
    run,
    fall_back_on,
    probe,
    http_get_action,
    exec_action,
    tcp_socket_action,
    update_settings,
)
# Extensions (`load("ext://...")`) are fetched from the network by Tilt: the Tiltfile uses none.
EXTENSIONS: dict[str, tuple[Any, ...]] = {}


def evaluate(
    tiltfile: str | Path = "Tiltfile", args: Sequence[str] = (), environ: Mapping[str, str] | None = None
) -> TiltRun:
    """Evaluate a Tiltfile as `tilt up -- <args>` would, with `os.getenv` reading `environ`."""
    path = Path(tiltfile)
    tilt = _Tilt(args, environ or {}, path.resolve().parent)
    module = sl.Module()
    for fn in TOP_LEVEL:
        module.add_callable(fn.__name__, tilt.recorder(fn.__name__, fn))
    for kind in ("string_list", "bool", "string"):
        module.add_callable(f"__define_{kind}", tilt.recorder(f"config.define_{kind}", tilt._define(kind)))
    module.add_callable("__parse", tilt.recorder("config.parse", tilt.parse))
    module.add_callable("__set_enabled", tilt.recorder("config.set_enabled_resources", tilt.set_enabled_resources))
    module.add_callable("__getenv", tilt.recorder("os.getenv", tilt.getenv))
    module.add_callable("listdir", tilt.recorder("listdir", tilt.listdir))

    globals_ = sl.Globals.extended_by([sl.LibraryExtension.StructType, sl.LibraryExtension.Json])
    dialect = sl.Dialect.extended()  # Tilt allows top-level if/for, as starlark-go does
    prelude = (
        "config = struct(define_string_list=__define_string_list, define_bool=__define_bool, "
        "define_string=__define_string, parse=__parse, set_enabled_resources=__set_enabled)\n"
        "os = struct(getenv=__getenv)\n"
    )

    def load(name: str) -> sl.FrozenModule:
        if name not in EXTENSIONS:
            raise TiltfileError(f"load({name!r}): no stub for this extension")
        ext = sl.Module()
        for fn in EXTENSIONS[name]:
            ext.add_callable(fn.__name__, tilt.recorder(fn.__name__, fn))
        return ext.freeze()

    try:
        sl.eval(module, sl.parse("prelude", prelude, dialect), globals_)
        sl.eval(module, sl.parse(str(path), path.read_text(), dialect), globals_, sl.FileLoader(load))
    except sl.StarlarkError as exc:
        raise TiltfileError(f"{path}: {exc}") from exc
    return tilt.run


def main(argv: list[str]) -> int:
    split = argv.index("--") if "--" in argv else len(argv)
    tiltfile = argv[0] if split > 0 else "Tiltfile"
    try:
        result = evaluate(tiltfile, argv[split + 1 :])
    except TiltfileError as exc:
        print(f"tilt_harness: {exc}", file=sys.stderr)
        return 1
    doc = {"flags": result.flags, "enabled": result.enabled, "calls": [[c.name, c.args] for c in result.calls]}
    print(json.dumps(doc, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
