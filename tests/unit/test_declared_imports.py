"""Every import of another Slipstream distribution is declared in the importing one's pyproject.

Each distribution (libs/*, services/*, tools/cli, and plugin packages under examples/) installs one
`slipstream.<package>` namespace portion. A module that imports `slipstream.X` where X belongs to a
different distribution needs that distribution in its `[project] dependencies`, or a fresh install
of the importer alone (a service image, a plugin) fails at the first import. Function-level and
`TYPE_CHECKING` imports count too: the first fails at run time, the second breaks the type check of
an image built without the dependency.
"""

from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Distribution:
    name: str
    root: Path
    packages: frozenset[str]  # the slipstream.<package> portions it installs
    declared: frozenset[str]  # distribution names of its [project] dependencies


def _requirement_name(spec: str) -> str:
    return re.split(r"[\s\[<>=!~;@]", spec.strip(), maxsplit=1)[0].lower().replace("_", "-")


def distributions(repo: Path = REPO) -> list[Distribution]:
    found: list[Distribution] = []
    for pyproject in sorted(repo.glob("*/*/pyproject.toml")):
        if ".venv" in pyproject.parts:
            continue
        project = tomllib.loads(pyproject.read_text())["project"]
        src = pyproject.parent / "src" / "slipstream"
        if not src.is_dir():
            continue
        packages = frozenset(p.name for p in src.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
        # An optional extra counts: a module that needs it is only imported when its feature is named
        # (an environment registered by entry point, say), and an install without it fails there.
        extras = [d for deps in project.get("optional-dependencies", {}).values() for d in deps]
        declared = frozenset(_requirement_name(d) for d in [*project.get("dependencies", []), *extras])
        found.append(Distribution(project["name"].lower(), pyproject.parent, packages, declared))
    return found


def slipstream_imports(source: str, filename: str) -> list[tuple[int, str]]:
    """(line, package) for every absolute import of slipstream.<package> in the source."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "slipstream" else [f"slipstream.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "slipstream" and len(parts) > 1:
                out.append((node.lineno, parts[1]))
    return out


def undeclared(dists: list[Distribution], repo: Path = REPO) -> list[str]:
    owner = {pkg: d for d in dists for pkg in d.packages}
    problems: list[str] = []
    for dist in dists:
        for path in sorted((dist.root / "src").rglob("*.py")):
            for line, pkg in slipstream_imports(path.read_text(), str(path)):
                other = owner.get(pkg)
                if other is None:
                    problems.append(
                        f"{path.relative_to(repo)}:{line} imports slipstream.{pkg}, which no distribution installs"
                    )
                elif other is not dist and other.name not in dist.declared:
                    problems.append(
                        f"{path.relative_to(repo)}:{line} imports slipstream.{pkg} "
                        f"but {dist.name} does not declare {other.name}"
                    )
    return problems


def test_the_checker_finds_an_undeclared_import(tmp_path: Path) -> None:
    # Guards the guard: two tiny distributions, one importing the other without declaring it.
    for name, deps, body in (("a", [], "import slipstream.b.thing\n"), ("b", [], "")):
        root = tmp_path / "libs" / name
        (root / "src" / "slipstream" / name).mkdir(parents=True)
        (root / "src" / "slipstream" / name / "m.py").write_text(body)
        (root / "pyproject.toml").write_text(f'[project]\nname = "slipstream-{name}"\ndependencies = {deps!r}\n')
    dists = distributions(tmp_path)
    assert sorted(d.name for d in dists) == ["slipstream-a", "slipstream-b"]
    problems = [p.split(" imports ")[1] for p in undeclared(dists, tmp_path)]
    assert problems == ["slipstream.b but slipstream-a does not declare slipstream-b"]
    (tmp_path / "libs" / "a" / "pyproject.toml").write_text(
        '[project]\nname = "slipstream-a"\ndependencies = ["slipstream-b>=0.1"]\n'
    )
    assert undeclared(distributions(tmp_path), tmp_path) == []


def test_every_cross_distribution_import_is_declared() -> None:
    dists = distributions()
    assert len(dists) >= 27, [d.name for d in dists]  # 19 libs, 7 services, the CLI at least
    problems = undeclared(dists)
    assert problems == [], "\n".join(problems)
