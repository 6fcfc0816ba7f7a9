"""The dependency arrows of the monorepo, checked with `ast` over every source file.

Services import libs, never each other; libs never import services or a tools package (the CLI,
the benches, the chaos suite); the schema package imports only msgspec and the standard library;
`slipstream` stays a PEP 420 namespace (no `src/slipstream/__init__.py` in any distribution).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("libs", "services", "tools")
SERVICE_PACKAGES = {
    p.parent.parent.parent.name: p.name
    for p in sorted(REPO.glob("services/*/src/slipstream/*"))
    if p.is_dir() and not p.name.startswith((".", "_"))
}
TOOL_PACKAGES = {
    p.name for p in sorted(REPO.glob("tools/*/src/slipstream/*")) if p.is_dir() and not p.name.startswith((".", "_"))
}
SCHEMAS_MAY_IMPORT = {"msgspec", "__future__"} | set(sys.stdlib_module_names)


def imports_of(source: str, filename: str = "<src>") -> list[tuple[int, str]]:
    """(line, absolute module name) for every import; relative imports stay inside the package."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
    return out


def _is(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(rel: Path, source: str) -> list[str]:
    """Every arrow the file at `rel` (relative to the repo root) breaks, as readable lines."""
    parts = rel.parts
    found: list[str] = []
    for line, module in imports_of(source, str(rel)):
        where = f"{rel}:{line} imports {module}"
        if parts[0] == "services":
            own = SERVICE_PACKAGES.get(parts[1])
            for pkg in SERVICE_PACKAGES.values():
                if pkg != own and _is(module, f"slipstream.{pkg}"):
                    found.append(f"{where}: a service imports another service")
        if parts[0] == "libs":
            if any(_is(module, f"slipstream.{pkg}") for pkg in SERVICE_PACKAGES.values()):
                found.append(f"{where}: a lib imports a service")
            if any(_is(module, f"slipstream.{pkg}") for pkg in TOOL_PACKAGES):
                found.append(f"{where}: a lib imports a tools package")
            if parts[1] == "schemas":
                top = module.split(".")[0]
                if top not in SCHEMAS_MAY_IMPORT and not _is(module, "slipstream.schemas"):
                    found.append(f"{where}: slipstream.schemas may import only msgspec and the stdlib")
    return found


def source_files() -> list[Path]:
    files: list[Path] = []
    for root in ROOTS:
        files.extend(p for p in (REPO / root).rglob("*.py") if ".venv" not in p.parts and "build" not in p.parts)
    return sorted(files)


def test_the_checker_sees_each_kind_of_violation() -> None:
    # Guards the guard: with a broken checker the repo-wide test below would pass vacuously.
    assert len(SERVICE_PACKAGES) == 7, SERVICE_PACKAGES
    svc_file = Path("services/reward-model/src/slipstream/reward_model/x.py")
    assert violations(svc_file, "from slipstream.learner import config") != []
    assert violations(svc_file, "import slipstream.rollout_worker.service as s") != []
    assert violations(svc_file, "from slipstream.reward_model import config\nimport slipstream.bus") == []
    lib_file = Path("libs/bus/src/slipstream/bus/x.py")
    assert violations(lib_file, "from slipstream.eval_gate.config import EvalGateConfig") != []
    assert violations(lib_file, "from slipstream import cli") != []
    assert violations(lib_file, "import slipstream.cli.main") != []
    assert {"cli", "bench", "chaos"} <= TOOL_PACKAGES, TOOL_PACKAGES
    assert violations(lib_file, "from slipstream.bench.main import write_json") != []
    assert violations(lib_file, "import slipstream.chaos.suite") != []
    schema_file = Path("libs/schemas/src/slipstream/schemas/x.py")
    assert violations(schema_file, "import numpy") != []
    assert violations(schema_file, "from slipstream.bus import connect_bus") != []
    assert violations(schema_file, "import json, typing\nimport msgspec\nfrom slipstream.schemas import codec") == []


def test_no_file_breaks_an_arrow() -> None:
    files = source_files()
    assert len(files) > 20, "found suspiciously few source files"
    broken = [v for f in files for v in violations(f.relative_to(REPO), f.read_text())]
    assert broken == [], "\n".join(broken)


def test_slipstream_is_a_namespace_package_everywhere() -> None:
    dists = [p for root in ROOTS for p in (REPO / root).glob("*/src/slipstream")]
    assert len(dists) >= 12, dists  # the libs, the services, the CLI
    offenders = [str(p / "__init__.py") for p in dists if (p / "__init__.py").exists()]
    assert offenders == [], f"remove these; `slipstream` is a PEP 420 namespace: {offenders}"
