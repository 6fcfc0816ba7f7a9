"""No import circles between the modules of any package, not even through TYPE_CHECKING or a function.

CONVENTIONS.md: a circle means two modules are one concept or a third is missing. The graph is
built with `ast` over every module under libs/*/src, services/*/src and tools/*/src: every
`import` and `from ... import` counts, wherever it stands (module level, `if TYPE_CHECKING:`,
inside a function), relative imports resolved against the importing module's package. An import
names the longest known module it reaches (`from slipstream.weights import chain` is an arrow to
`slipstream.weights.chain`; `from slipstream.weights import WeightsError` one to the package).
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SOURCE_GLOBS = ("libs/*/src", "services/*/src", "tools/*/src")


class Module:
    """One module: its source, whether it is a package's `__init__`, and where it lives (for messages)."""

    def __init__(self, source: str, *, is_package: bool = False, path: str = "") -> None:
        self.source = source
        self.is_package = is_package
        self.path = path


def repo_modules() -> dict[str, Module]:
    """Every module of every package in the repo, by dotted name."""
    out: dict[str, Module] = {}
    for pattern in SOURCE_GLOBS:
        for src in sorted(REPO.glob(pattern)):
            for path in sorted(src.rglob("*.py")):
                parts = list(path.relative_to(src).with_suffix("").parts)
                is_package = parts[-1] == "__init__"
                name = ".".join(parts[:-1] if is_package else parts)
                out[name] = Module(path.read_text(), is_package=is_package, path=str(path.relative_to(REPO)))
    return out


def _known(name: str, modules: Mapping[str, Module]) -> str | None:
    """The longest prefix of `name` that is a module here (None: outside every package)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_edges(modules: Mapping[str, Module]) -> dict[str, dict[str, list[int]]]:
    """module -> imported module -> the lines importing it (every import, wherever it stands)."""
    graph: dict[str, dict[str, list[int]]] = {}
    for name, module in modules.items():
        package = name if module.is_package else name.rpartition(".")[0]
        out: dict[str, list[int]] = {}
        for node in ast.walk(ast.parse(module.source, module.path or name)):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                targets = [f"{origin}.{alias.name}" for alias in node.names]
            for target in targets:
                reached = _known(target, modules)
                if reached is not None and reached != name:
                    out.setdefault(reached, []).append(node.lineno)
        graph[name] = out
    return graph


def circles(graph: Mapping[str, Mapping[str, list[int]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = [(root, sorted(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, pending = work[-1]
            if pending:
                nxt = pending.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph.get(nxt, {}))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def describe(component: list[str], modules: Mapping[str, Module], graph: Mapping[str, Mapping[str, list[int]]]) -> str:
    """The circle's modules and the import lines that close it, one per line."""
    lines = [" <-> ".join(component)]
    members = set(component)
    for name in component:
        source = modules[name].source.splitlines()
        for target, numbers in sorted(graph[name].items()):
            if target in members:
                for n in numbers:
                    lines.append(f"  {modules[name].path or name}:{n}: {source[n - 1].strip()}  (-> {target})")
    return "\n".join(lines)


def test_the_checker_finds_a_circle_closed_only_by_type_checking_and_function_imports() -> None:
    # Guards the guard: the repo-wide test below would pass vacuously with a checker that saw nothing.
    modules = {
        "pkg": Module("", is_package=True),
        "pkg.a": Module(
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n", path="pkg/a.py"
        ),
        "pkg.b": Module("def f():\n    from .a import A\n    return A\n", path="pkg/b.py"),
        "pkg.c": Module("from pkg import a\nimport pkg.b\n", path="pkg/c.py"),
    }
    graph = import_edges(modules)
    assert graph["pkg.a"] == {"pkg.b": [3]}
    assert graph["pkg.b"] == {"pkg.a": [2]}  # relative, inside a function
    assert graph["pkg.c"] == {"pkg.a": [1], "pkg.b": [2]}
    found = circles(graph)
    assert found == [["pkg.a", "pkg.b"]]
    text = describe(found[0], modules, graph)
    assert "pkg/a.py:3: from pkg.b import B  (-> pkg.b)" in text
    assert "pkg/b.py:2: from .a import A  (-> pkg.a)" in text
    # Without b's import there is no circle (c only imports).
    modules["pkg.b"] = Module("def f():\n    return 1\n", path="pkg/b.py")
    assert circles(import_edges(modules)) == []


def test_a_three_module_circle_is_one_component() -> None:
    modules = {
        "x.one": Module("from x.two import T\n"),
        "x.two": Module("from x import three\n"),
        "x": Module("", is_package=True),
        "x.three": Module("import x.one\n"),
        "x.four": Module("import x.one\n"),
    }
    assert circles(import_edges(modules)) == [["x.one", "x.three", "x.two"]]


def test_no_module_of_any_package_is_in_an_import_circle() -> None:
    modules = repo_modules()
    assert len(modules) > 300, len(modules)  # every package was found
    assert "slipstream.weights.chain" in modules and "slipstream.stack.local" in modules
    graph = import_edges(modules)
    found = circles(graph)
    assert not found, f"{len(found)} import circle(s):\n" + "\n".join(describe(c, modules, graph) for c in found)
