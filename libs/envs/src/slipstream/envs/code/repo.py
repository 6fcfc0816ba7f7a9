"""Repository tasks: one small bug planted in a real package, caught by that package's own tests.

The package is toolz 1.2.0 (BSD-3-Clause; pure Python, its tests are plain `test_*` functions
shipped inside the wheel, so they run under the sandbox's plain runner without pytest). It is a
pinned dependency of this library: the tree comes from the installed wheel, never a download.

Mutations are seeded and deterministic: `sites(module)` lists every token of a module that one
of `SWAPS` changes (a comparison flipped, `+`/`-` swapped, `and`/`or` swapped) or that is a small
integer (off by one); site i of a module is always the same token. A mutant becomes a task only
if the module's own tests fail on it and pass without it: `survey()` runs every mutant's tests
in a bubblewrap sandbox (a mutant may loop forever: the wall-clock limit ends it) and keeps the
caught ones with the names of the tests that fail. The survey's result ships as
`toolz_mutants.json` (`python -m slipstream.envs.code.repo > .../toolz_mutants.json` redoes it,
about a minute on 2 cores); tests/integration/test_code_repo.py checks a sample of it afresh.

A task's key is `repo:<module>:<site>`. Its tree: the package (the mutated module among the
rest) and its tests, plus `test_task.py`, which imports the **subset** of the module's tests the
task is graded by (the failing ones, at most `MAX_FAILING`, and up to `PASSING` that pass on the
mutant, for the fraction), so grading takes well under a second. The package's tests and
test_task.py are protected: grading runs the task's own copies.
"""

from __future__ import annotations

import asyncio
import io
import json
import random
import shutil
import sys
import tempfile
import tokenize
from functools import cache
from importlib import metadata, resources
from pathlib import Path
from typing import Any

PACKAGE = "toolz"
VERSION = "1.2.0"
MODULES = ("itertoolz", "dicttoolz", "recipes")  # those whose tests need no pytest
SWAPS = {
    "<": "<=",
    "<=": "<",
    ">": ">=",
    ">=": ">",
    "==": "!=",
    "!=": "==",
    "+": "-",
    "-": "+",
    "and": "or",
    "or": "and",
}
MAX_FAILING = 4
PASSING = 2
CATALOGUE = "toolz_mutants.json"
TASK_TESTS = "test_task.py"


class Site(tuple[int, int, str, str]):
    """(line, column, old token, new token): one planted bug."""

    __slots__ = ()

    @property
    def line(self) -> int:
        return self[0]

    @property
    def col(self) -> int:
        return self[1]

    @property
    def old(self) -> str:
        return self[2]

    @property
    def new(self) -> str:
        return self[3]


@cache
def package_files() -> dict[str, str]:
    """Every .py file of the installed package, path (under the tree) -> text; checks the pinned version."""
    found = metadata.version(PACKAGE)
    if found != VERSION:
        raise RuntimeError(f"repository tasks are surveyed on {PACKAGE} {VERSION}, but {found} is installed")
    root = resources.files(PACKAGE)
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        for child in sorted(node.iterdir(), key=lambda c: c.name):
            if child.is_dir():
                if child.name != "__pycache__":
                    walk(child, f"{prefix}{child.name}/")
            elif child.name.endswith(".py"):
                out[f"{prefix}{child.name}"] = child.read_text()

    walk(root, f"{PACKAGE}/")
    return out


def module_path(module: str) -> str:
    if module not in MODULES:
        raise KeyError(f"no repository module {module!r} (one of {', '.join(MODULES)})")
    return f"{PACKAGE}/{module}.py"


def test_module(module: str) -> str:
    return f"{PACKAGE}.tests.test_{module}"


@cache
def sites(module: str) -> tuple[Site, ...]:
    """Every mutable token of `module`, in source order (deterministic for a given source)."""
    source = package_files()[module_path(module)]
    out: list[Site] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        line, col = tok.start
        if (tok.type == tokenize.OP and tok.string in SWAPS) or (tok.type == tokenize.NAME and tok.string in SWAPS):
            out.append(Site((line, col, tok.string, SWAPS[tok.string])))
        elif tok.type == tokenize.NUMBER and tok.string.isdigit() and int(tok.string) <= 9:
            out.append(Site((line, col, tok.string, str(int(tok.string) + 1))))
    return tuple(out)


def mutate(source: str, site: Site) -> str:
    lines = source.splitlines(keepends=True)
    text = lines[site.line - 1]
    if text[site.col : site.col + len(site.old)] != site.old:
        raise ValueError(f"site {site} does not match the source")
    lines[site.line - 1] = text[: site.col] + site.new + text[site.col + len(site.old) :]
    return "".join(lines)


def unique_snippet(mutated: str, original: str, line: int) -> tuple[str, str]:
    """The mutated line, widened (down, then up) until it occurs once in the file, and the same lines fixed."""
    m, o = mutated.splitlines(keepends=True), original.splitlines(keepends=True)
    lo = hi = line - 1
    while mutated.count("".join(m[lo : hi + 1])) != 1:
        if hi + 1 < len(m):
            hi += 1
        elif lo > 0:
            lo -= 1
        else:
            break
    return "".join(m[lo : hi + 1]), "".join(o[lo : hi + 1])


@cache
def catalogue() -> dict[str, dict[str, Any]]:
    """The surveyed mutants its tests catch, by key (`repo:<module>:<site>`)."""
    data = json.loads(resources.files("slipstream.envs.code").joinpath(CATALOGUE).read_text())
    if data["package"] != PACKAGE or data["version"] != VERSION:
        raise RuntimeError(f"{CATALOGUE} surveys {data['package']} {data['version']}, not {PACKAGE} {VERSION}")
    return {m["key"]: m for m in data["mutants"]}


def repo_keys() -> list[str]:
    return sorted(catalogue(), key=lambda k: (k.split(":")[1], int(k.split(":")[2])))


def repo_files(key: str) -> tuple[dict[str, str], str, dict[str, Any]]:
    """The task's tree (the package with one module mutated, its tests, test_task.py), the mutated path,
    and the catalogue entry. KeyError for a key that is not a surveyed, caught mutant."""
    entry = catalogue().get(key)
    if entry is None:
        raise KeyError(f"no repository task {key!r} (not a surveyed mutant its tests catch)")
    module = key.split(":")[1]
    path = module_path(module)
    files = dict(package_files())
    files[path] = mutate(files[path], Site(tuple(entry["site"])))
    names = ", ".join(entry["tests"])
    files[TASK_TESTS] = (
        f"# The {PACKAGE} tests this task is graded by (a subset of its own suite).\n"
        f"from {test_module(module)} import {names}  # noqa: F401\n"
    )
    return files, path, entry


# -- the survey ----------------------------------------------------------------------------------

# Runs every test_* of one module; prints the names that fail (and the first failure's message).
SURVEY_RUNNER = """import importlib, json, sys, traceback
module = importlib.import_module(sys.argv[1])
failed, first = [], ""
names = sorted(n for n in dir(module) if n.startswith("test_") and callable(getattr(module, n)))
for name in names:
    try:
        getattr(module, name)()
    except Exception as exc:
        failed.append(name)
        if not first:
            line = traceback.extract_tb(exc.__traceback__)[-1].line or ""
            first = f"{name}: {type(exc).__name__}: {line}".strip()
print(json.dumps({"tests": names, "failed": failed, "first": first}))
"""


async def _run_survey(modules: tuple[str, ...], wall_s: float) -> dict[str, Any]:
    from slipstream.sandbox import BwrapProvider, Limits

    files = package_files()
    root = Path(tempfile.mkdtemp(prefix="slipstream-survey-"))
    limits = Limits(wall_s=wall_s, cpu_s=max(1, int(wall_s)), memory_mb=256, processes=16)
    provider = BwrapProvider(root / "sandboxes", limits=limits)
    base = root / "base"
    for path, text in {**files, "_survey.py": SURVEY_RUNNER}.items():
        (base / path).parent.mkdir(parents=True, exist_ok=True)
        (base / path).write_text(text)
    mutants: list[dict[str, Any]] = []
    counts: dict[str, dict[str, int]] = {}
    try:
        for module in modules:
            path = module_path(module)
            clean = await _survey_one(provider, base, path, files[path], module)
            if clean is None or clean["failed"]:
                raise RuntimeError(f"{test_module(module)} does not pass on the unmutated package: {clean}")
            tally = counts.setdefault(module, {"sites": 0, "caught": 0, "missed": 0, "hung": 0})
            for i, site in enumerate(sites(module)):
                tally["sites"] += 1
                mutated = mutate(files[path], site)
                report = await _survey_one(provider, base, path, mutated, module)
                if report is None:
                    tally["hung"] += 1  # an endless loop or a crash: not a task a few seconds can grade
                    continue
                if not report["failed"]:
                    tally["missed"] += 1
                    continue
                tally["caught"] += 1
                passing = [t for t in report["tests"] if t not in report["failed"]]
                rng = random.Random(f"repo|{module}|{i}")
                graded = sorted(report["failed"][:MAX_FAILING] + rng.sample(passing, min(PASSING, len(passing))))
                mutants.append(
                    {
                        "key": f"repo:{module}:{i}",
                        "site": list(site),
                        "failing": report["failed"],
                        "tests": graded,
                        "first_failure": report["first"],
                    }
                )
    finally:
        await provider.aclose()
        shutil.rmtree(root, ignore_errors=True)
    return {"package": PACKAGE, "version": VERSION, "modules": list(modules), "counts": counts, "mutants": mutants}


async def _survey_one(provider: Any, base: Path, path: str, source: str, module: str) -> dict[str, Any] | None:
    sandbox = await provider.create(base)
    try:
        await sandbox.write(path, source)
        result = await sandbox.exec(["python3", "_survey.py", test_module(module)])
    finally:
        await sandbox.close()
    if result.reason not in ("ok", "exit"):
        return None
    try:
        return dict(json.loads(result.stdout.strip().splitlines()[-1]))
    except (IndexError, ValueError):
        return None


def survey(modules: tuple[str, ...] = MODULES, wall_s: float = 5.0) -> dict[str, Any]:
    """Every mutant of `modules`, run against the module's own tests; the caught ones (see the module doc)."""
    return asyncio.run(_run_survey(modules, wall_s))


if __name__ == "__main__":
    out = survey()
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
    print(json.dumps(out["counts"]), file=sys.stderr)
