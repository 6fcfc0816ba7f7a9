"""The stages of deploy/docker/Dockerfile and the final targets deploy/docker/build.sh builds.

Why: tests compare images with the code (the libs a service image copies against the service's
dependencies, entry points against console scripts) and with the manifests and the Tiltfile
(every image used is a target). A line-level reader of the few instructions the Dockerfile uses
is enough for that and needs no Docker engine.
"""

from __future__ import annotations

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
