"""The stages of deploy/docker/Dockerfile and the final targets deploy/docker/build.sh builds.

Why: tests compare images with the code (the libs a service image copies against the service's
dependencies and against what the copied code imports, entry points against console scripts) and
with the manifests and the Tiltfile (every image used is a target). A line-level reader of the
few instructions the Dockerfile uses is enough for that and needs no Docker engine.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
BUILD_SCRIPT = REPO / "deploy" / "docker" / "build.sh"


@dataclass
class Stage:
    """One `FROM <base> AS <name>` stage: what it copies, who it runs as, what it runs."""

    name: str
    base: str
    copies: list[tuple[str | None, str]] = field(default_factory=list)  # (--from stage, source)
    user: str | None = None
    entrypoint: list[str] | None = None
    expose: list[int] = field(default_factory=list)
    healthcheck: list[str] | None = None


def stages(path: Path = DOCKERFILE) -> dict[str, Stage]:
    out: dict[str, Stage] = {}
    current: Stage | None = None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if m := re.match(r"FROM (\S+) AS (\S+)$", line):
            current = out[m[2]] = Stage(m[2], m[1])
        elif current is None:
            continue
        elif m := re.match(r"COPY (?:--from=(\S+) )?(?:--chown=\S+ )?(\S+) \S+$", line):
            current.copies.append((m[1], m[2]))
        elif line.startswith("USER "):
            current.user = line.split()[1]
        elif line.startswith("EXPOSE "):
            current.expose += [int(p) for p in line.split()[1:]]
        elif line.startswith("HEALTHCHECK "):
            current.healthcheck = json.loads(line.split(" CMD ", 1)[1])
        elif line.startswith("ENTRYPOINT "):
            try:
                current.entrypoint = json.loads(line.split(" ", 1)[1])
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{n}: ENTRYPOINT must be in exec (JSON) form") from None
    return out


def root_base(all_stages: dict[str, Stage], name: str) -> str:
    """The external image (or build ARG) a stage ultimately starts from."""
    while name in all_stages:
        name = all_stages[name].base
    return name


def copied_sources(all_stages: dict[str, Stage], name: str) -> set[str]:
    """Repository paths a stage copies from the build context (trailing '/' dropped)."""
    return {src.rstrip("/") for frm, src in all_stages[name].copies if frm is None}


def build_targets(path: Path = BUILD_SCRIPT) -> list[str]:
    """The TARGETS list of deploy/docker/build.sh (what `make images` builds)."""
    m = re.search(r"^TARGETS=\((.*)\)$", path.read_text(), re.M)
    if not m:
        raise ValueError(f"{path}: no TARGETS=(...) line")
    return m[1].split()


def builder(all_stages: dict[str, Stage], name: str) -> str:
    """The `*-builder` stage (cpu-builder, cuda-builder) a build stage installs into."""
    while all_stages[name].base in all_stages and not all_stages[name].base.endswith("-builder"):
        name = all_stages[name].base
    return all_stages[name].base


def package_dirs() -> dict[str, str]:
    """`bus` -> `libs/bus`: the repository directory of each `slipstream.<pkg>`."""
    return {
        p.name: str(p.parents[2].relative_to(REPO))
        for p in REPO.glob("*/*/src/slipstream/*")
        if p.is_dir() and not p.name.startswith(("_", "."))
    }


def runtime_imports(source: str) -> set[str]:
    """The `<pkg>` of every `slipstream.<pkg>` a module imports at run time (imports under
    `if TYPE_CHECKING:` never run, so an image need not carry them)."""
    tree = ast.parse(source)
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found |= {n.split(".")[1] for n in names if n.startswith("slipstream.")}
    return found
