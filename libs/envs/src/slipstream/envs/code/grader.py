"""The grader the agent cannot reach: a patch's tests, run so that the patch cannot fake their result.

Three sandboxes, two of them trusted (they never load the agent's code), for tasks graded through
one function (bugfix, HumanEval):

1. `record` (trusted, cached per task): the reference solution and the task's tests, with the
   function under test wrapped to record every call's arguments and result by value; then the
   reference called on perturbed copies of those arguments (the *hidden* cases, a function of
   the task key, never written into the tree).
2. `calls` (the agent's tree): the agent's module imported from /work and called on every
   recorded and hidden argument list, in a shuffled order; each result comes back by value as a
   tagged literal of exact builtin types, or as an error ("not a plain value: Anything").
3. `replay` (trusted): the tests run again against the reference module with the function under
   test replaced by a lookup of the agent's results. The asserts (HumanEval's `check` included,
   tolerances and all) run where no agent code ever ran; hidden cases are compared here, in the
   grader's process, by value *and* type against the reference's results.

Repository tasks (a package's own tests must call the package in-process) run in one sandbox in
`tests` mode, and only the mutated module is taken from the patch (the rest of the package is
restored like the tests): see runner.py for the audit hook and the type guard on results.

Every run is `python3 -I -S -c RUNNER` with the payload (and a per-run nonce) on stdin: the runner
is not a file of the tree, the tree is appended to sys.path after the runner's own imports, and
only report lines that carry the nonce count. The run must also exit 0 (the runner's own
`os._exit(0)` after its report): an earlier exit, a timeout or a killed process leaves no report
and scores 0. Anything the audit hook refused scores 0 with the refusal as the reason.
"""

from __future__ import annotations

import ast
import json
import random
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from slipstream.envs.code.runner import RUNNER
from slipstream.envs.code.tasks import CodeTask
from slipstream.sandbox import BwrapProvider, ExecResult, Limits, Snapshot

COMMAND = ("python3", "-I", "-S", "-c", RUNNER)
OUTPUT_BYTES = 4 * 2**20
HIDDEN_CASES = 8  # perturbed argument lists per bugfix task, beside its visible tests


class GraderError(RuntimeError):
    """The trusted side failed (the reference does not pass its own tests): the task's fault, not the agent's."""


@dataclass(frozen=True)
class CallSpec:
    """Grade by calling one function: `module` (imported from the tree) and its `entry` function."""

    key: str
    module: str
    entry: str
    modules: tuple[tuple[str, str], ...]  # (name, source): the reference module first, then the test modules
    tests: tuple[str, ...]  # the test modules whose test_* functions run
    hidden: int = 0  # perturbed argument lists, compared by value and type
    strict: bool = False  # the visible calls' results must also have the reference's exact types
    extra: tuple[str, ...] = ()  # hidden argument lists given by the task (encoded), beside the perturbed ones


@dataclass(frozen=True)
class PackageSpec:
    """Grade a package's own tests in-process: only `path` (the mutated module) comes from the patch."""

    key: str
    path: str
    module: str  # dotted name of the mutated module
    aliases: tuple[str, ...]  # modules that re-export its functions (the package)
    names: tuple[str, ...]  # its functions, whose results are type-checked
    classes: tuple[str, ...]  # classes the package itself defines (their instances are allowed)
    modules: tuple[tuple[str, str], ...]  # the task's own test sources
    tests: tuple[str, ...]


@dataclass(frozen=True)
class Verdict:
    passed: int
    total: int
    reason: str

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total


def encode(value: Any) -> str:
    """`value` as the runner's tagged literal (exact builtin types only, as the runner's `enc`)."""
    t = type(value)
    if value is None:
        return "('n',)"
    tag = {bool: "b", int: "i", str: "s", bytes: "y"}.get(t)
    if tag:
        return f"({tag!r},{value!r})"
    if t is float:
        return f"('f',{repr(value)!r})"
    if t in (list, tuple, set, frozenset):
        tag = {list: "l", tuple: "t", set: "S", frozenset: "F"}[t]  # type: ignore[index]
        return f"({tag!r},[" + ",".join(encode(x) for x in value) + "])"
    if t is dict:
        return "('d',[" + ",".join(f"({encode(k)},{encode(v)})" for k, v in value.items()) + "])"
    raise ValueError(f"not a plain value: {t.__qualname__}")


def decode(node: Any) -> Any:
    """A value from the runner's tagged literal (already `ast.literal_eval`-ed)."""
    tag = node[0]
    if tag == "n":
        return None
    if tag in ("i", "b", "s", "y"):
        return node[1]
    if tag == "f":
        return float(node[1])
    if tag == "l":
        return [decode(x) for x in node[1]]
    if tag == "t":
        return tuple(decode(x) for x in node[1])
    if tag == "S":
        return {decode(x) for x in node[1]}
    if tag == "F":
        return frozenset(decode(x) for x in node[1])
    if tag == "d":
        return {decode(k): decode(v) for k, v in node[1]}
    raise ValueError(f"bad tag {tag!r} in a runner report")


@dataclass
class Run:
    """One runner run, parsed: its report (None when it made none) and what the audit hook refused."""

    result: ExecResult
    report: Any
    refused: list[str]

    def failure(self) -> str:
        """Why this run cannot be trusted or scored ('' when it can)."""
        if self.refused:
            return "refused by the grader: " + "; ".join(self.refused)
        if self.result.reason != "ok":
            detail = self.result.detail or self.result.reason
            return f"the test run did not finish ({detail}){' before reporting' if self.report is None else ''}"
        if self.report is None:
            return (
                "no report from the test runner: the process exited with status 0 before the tests finished "
                "(the code under test ended it)"
            )
        return ""


async def run(provider: BwrapProvider, base: Path | Snapshot | None, payload: dict[str, Any], limits: Limits) -> Run:
    """The runner in a fresh sandbox over `base` (None: an empty tree) with `payload` on stdin."""
    nonce = secrets.token_hex(16)
    data = json.dumps({**payload, "nonce": nonce}).encode()
    lim = msgspec.structs.replace(limits, output_bytes=OUTPUT_BYTES)
    sandbox = await provider.create(base)
    try:
        result = await sandbox.exec(list(COMMAND), stdin=data, limits=lim)
    finally:
        await sandbox.close()
    report: Any = None
    refused: list[str] = []
    for line in result.stdout.splitlines():
        head, _, rest = line.partition(" ")
        if head != nonce:
            continue
        kind, _, body = rest.partition(" ")
        try:
            value = ast.literal_eval(body)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            continue  # cut at the output limit
        if kind == "refused" and isinstance(value, str):
            refused.append(value)
        elif kind == "result":
            if report is not None:
                refused.append("two reports carry this run's nonce (one of them forged)")
            report = decode(value)
    return Run(result, report, refused)


# -- grading by calls -----------------------------------------------------------------------------

_RECORDS: dict[CallSpec, dict[str, Any]] = {}


async def record(provider: BwrapProvider, spec: CallSpec, limits: Limits) -> dict[str, Any]:
    """The reference's calls, results and hidden cases (cached: a pure function of the spec)."""
    if spec in _RECORDS:
        return _RECORDS[spec]
    payload = {
        "mode": "record",
        "module": spec.module,
        "entry": spec.entry,
        "modules": spec.modules,
        "tests": spec.tests,
        "probes": spec.hidden,
        "probe_seed": f"hidden|{spec.key}",
        "extra": spec.extra,
    }
    done = await run(provider, None, payload, limits)
    why = done.failure()
    if why:
        raise GraderError(f"{spec.key}: the reference run failed: {why}; stderr: {done.result.stderr[-500:]}")
    failing = [(name, msg) for name, ok, msg in done.report["tests"] if not ok]
    if failing or not done.report["tests"]:
        raise GraderError(f"{spec.key}: the reference does not pass its own tests: {failing or 'no tests'}")
    if len(_RECORDS) > 4096:
        _RECORDS.clear()
    _RECORDS[spec] = done.report
    return done.report


async def grade_calls(provider: BwrapProvider, spec: CallSpec, tree: Path | Snapshot, limits: Limits) -> Verdict:
    ref = await record(provider, spec, limits)
    calls: dict[str, str] = ref["calls"]
    probes: dict[str, str] = ref["probes"]
    keys = sorted({*calls, *probes})
    random.Random(f"order|{spec.key}").shuffle(keys)
    total = len(ref["tests"]) + len(probes)
    played = await run(
        provider, tree, {"mode": "calls", "module": spec.module, "entry": spec.entry, "calls": keys}, limits
    )
    why = played.failure()
    if why:
        return Verdict(0, total, why)
    if "import" in played.report:
        return Verdict(0, total, f"{spec.module} did not import: {played.report['import']}")
    replies: dict[str, str] = played.report
    results = {k: ast.literal_eval(replies[k]) if k in replies else ("error", "no result") for k in keys}
    not_plain = sorted({r[1] for r in results.values() if r[0] == "error" and r[1].startswith("not a plain value")})
    if all(_same(results[k], calls[k]) for k in calls):
        # Every visible call returned exactly the reference's value and type: the tests would see
        # what they saw in the recording, where they all passed; no replay needed.
        test_outcomes = [(name, True, "") for name, _, _ in ref["tests"]]
    else:
        replay = await run(
            provider,
            None,
            {
                "mode": "replay",
                "module": spec.module,
                "entry": spec.entry,
                "modules": spec.modules,
                "tests": spec.tests,
                "replies": {k: repr(results[k]) for k in calls},
            },
            limits,
        )
        why = replay.failure()
        if why:
            raise GraderError(f"{spec.key}: the replay run failed: {why}; stderr: {replay.result.stderr[-500:]}")
        test_outcomes = replay.report["tests"]
    failed_tests = [f"{name}: {msg}" for name, ok, msg in test_outcomes if not ok]
    wrong_hidden = [k for k in probes if not _same(results[k], probes[k])]
    passed = len(test_outcomes) - len(failed_tests) + len(probes) - len(wrong_hidden)
    notes = []
    if spec.strict:
        wrong_type = [k for k in calls if results[k][0] == "ok" and not _same(results[k], calls[k])]
        if wrong_type and not failed_tests:
            failed_tests.append("a visible result of another type than the reference's")
            passed = min(passed, total - 1)
    if wrong_hidden and not failed_tests:
        # Every visible test passes and hidden cases fail: fit to the visible tests (a lookup table).
        passed = 0
        notes.append(f"passes the visible tests but {len(wrong_hidden)}/{len(probes)} hidden cases are wrong")
    elif wrong_hidden:
        notes.append(f"{len(wrong_hidden)}/{len(probes)} hidden cases wrong")
    if failed_tests:
        notes.insert(0, f"failing: {failed_tests[0]}")
    if not_plain:
        notes.append(not_plain[0])
    return Verdict(passed, total, f"{passed}/{total} tests passed" + "".join(f"; {n}" for n in notes))


def _same(result: tuple[Any, ...], reference: str) -> bool:
    """The agent's result equals the reference's by value and by type (tags compared, not ==)."""
    return result[0] == "ok" and result[1] == ast.literal_eval(reference)


# -- grading a package's own tests ------------------------------------------------------------------


async def grade_package(provider: BwrapProvider, spec: PackageSpec, tree: Path | Snapshot, limits: Limits) -> Verdict:
    payload = {
        "mode": "tests",
        "guard": {"module": spec.module, "aliases": spec.aliases, "names": spec.names, "classes": spec.classes},
        "modules": spec.modules,
        "tests": spec.tests,
    }
    played = await run(provider, tree, payload, limits)
    why = played.failure()
    if why:
        return Verdict(0, max(1, len(spec.names) and 1), why)
    if "import" in played.report:
        return Verdict(0, 1, f"the tests did not load: {played.report['import']}")
    tests = played.report["tests"]
    failing = [f"{name}: {msg}" for name, ok, msg in tests if not ok]
    passed = len(tests) - len(failing)
    return Verdict(
        passed, len(tests), f"{passed}/{len(tests)} tests passed" + (f"; failing: {failing[0]}" if failing else "")
    )


# -- specs: how each task kind is graded ------------------------------------------------------------


def _module_name(path: str) -> str:
    return path[: -len(".py")].replace("/", ".").removesuffix(".__init__")


def spec_of(task: CodeTask) -> CallSpec | PackageSpec:
    """How `task` is graded: through its one function (bugfix, HumanEval) or its package's tests (repo)."""
    ref = json.loads(task.reference)
    tests = tuple((_module_name(p), task.files[p]) for p in task.tests)
    if task.kind == "repo":
        path = task.meta["module"]
        from slipstream.envs.code.repo import PACKAGE, package_files

        package = package_files()
        reference = ast.parse(package[path])
        names = tuple(n.name for n in reference.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))
        classes = sorted(
            {n.name for src in package.values() for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ClassDef)}
        )
        # The test modules the task's tests import, from the task's own copies, before the task's file.
        own = tuple(
            (_module_name(p), task.files[p])
            for p in sorted(task.files)
            if p.startswith(f"{PACKAGE}/tests/test_") and _module_name(p) in task.files[task.tests[0]]
        )
        return PackageSpec(
            key=task.key,
            path=path,
            module=_module_name(path),
            aliases=(PACKAGE,),
            names=names,
            classes=tuple(classes),
            modules=own + tests,
            tests=tuple(name for name, _ in tests),
        )
    path = ref["path"]
    extra: tuple[str, ...] = ()
    if task.kind == "humaneval":
        source, entry, hidden, strict = ref["content"], task.meta["entry_point"], 0, False
    elif task.kind == "programs":
        from slipstream.envs.code import programs

        # The generator's own hidden cases (chosen to tell the fix from the bug), none perturbed.
        source, entry, hidden, strict = task.meta["fixed"], task.meta["entry_point"], 0, True
        extra = tuple(encode((tuple(args), ())) for args, _ in programs.hidden_cases(task.key))
    else:
        source = task.meta["fixed"]
        entry = task.meta.get("entry_point") or next(
            n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)
        )
        hidden, strict = HIDDEN_CASES, True
    module = _module_name(path)
    return CallSpec(
        key=task.key,
        module=module,
        entry=entry,
        modules=((module, source), *tests),
        tests=tuple(name for name, _ in tests),
        hidden=hidden,
        strict=strict,
        extra=extra,
    )


def graded_paths(task: CodeTask, spec: CallSpec | PackageSpec) -> frozenset[str] | None:
    """The only tree paths a patch may change for grading (None: any path but the protected ones).
    A repository task takes the mutated module alone: the rest of the package is the task's."""
    return frozenset({spec.path}) if isinstance(spec, PackageSpec) else None


async def grade(provider: BwrapProvider, task: CodeTask, tree: Path | Snapshot, limits: Limits) -> Verdict:
    spec = spec_of(task)
    if isinstance(spec, PackageSpec):
        return await grade_package(provider, spec, tree, limits)
    return await grade_calls(provider, spec, tree, limits)
