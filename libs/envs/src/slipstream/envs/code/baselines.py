"""Trivial policies for the `code` bug-fix tasks, to score beside a trained model (issue 34).

Each maps a task (its `CodeTask`) to a patch `{path: content}` without a model:

- `unmodified`: no edit (the buggy file as given);
- `docstring_rule`: the fixed rule that solved every old `bugfix` task: a word of the docstring names
  an operator ("sum" +, "difference" -, "product" *, and, more generous than the old tasks needed,
  "plus" +, "minus" -, "times" *, "larger"/"greater" >, "smaller"/"less" <, "at least" >=, "at most" <=);
  the first operator of that class in the function's body becomes it;
- `random_edit`: one random one-token edit of the body (an operator or comparison swapped for
  another, an integer moved by one, a name replaced by another of the function's names), seeded.

`slipstream bench code-baselines` grades them with the env's own grader (`Code.grade`).
"""

from __future__ import annotations

import random
import re

from slipstream.envs.code.tasks import CodeTask

ARITH = ("+", "-", "*", "//", "%")
COMPARE = (">", "<", ">=", "<=", "==", "!=")
_WORDS = (
    ("difference", "-"),
    ("product", "*"),
    ("sum", "+"),
    ("minus", "-"),
    ("times", "*"),
    ("plus", "+"),
    ("at least", ">="),
    ("at most", "<="),
    ("larger", ">"),
    ("greater", ">"),
    ("smaller", "<"),
    ("less", "<"),
)
# An operator between spaces (augmented assignments too: "t -= i"), then a comparison.
_ARITH_RE = re.compile(r" (\+|-|\*|//|%)(=?) ")
_COMPARE_RE = re.compile(r" (>=|<=|==|!=|>|<) ")
_NAME_RE = re.compile(r"\b[A-Za-z_][A-Za-z_0-9]*\b")
_INT_RE = re.compile(r"(?<![A-Za-z_0-9])\d+")
_KEYWORDS = frozenset({"return", "if", "else", "for", "in", "range", "def", "and", "or", "not"})


def _split(source: str) -> tuple[str, str]:
    """(signature and one-line docstring, body): the body is what follows the docstring's line."""
    head, sep, body = source.partition('"""\n')
    return head + sep, body


def _module(code: CodeTask) -> tuple[str, str]:
    path = "ops.py" if "ops.py" in code.files else next(p for p in code.files if p not in code.tests)
    return path, code.files[path]


def unmodified(code: CodeTask) -> dict[str, str]:
    return {}


def docstring_rule(code: CodeTask) -> dict[str, str]:
    path, source = _module(code)
    head, body = _split(source)
    doc = head.lower()
    for word, op in _WORDS:
        if word in doc:
            pattern = _COMPARE_RE if op in COMPARE else _ARITH_RE
            match = pattern.search(body)
            if match is None:
                return {}
            tail = match.group(2) if pattern is _ARITH_RE else ""
            new = body[: match.start()] + f" {op}{tail} " + body[match.end() :]
            return {path: head + new} if new != body else {}
    return {}


def random_edit(code: CodeTask, seed: int) -> dict[str, str]:
    rng = random.Random(f"{code.key}|{seed}")
    path, source = _module(code)
    head, body = _split(source)
    names = sorted({m.group() for m in _NAME_RE.finditer(body)} - _KEYWORDS)
    sites: list[tuple[int, int, str]] = []
    for m in _ARITH_RE.finditer(body):
        sites.append((m.start(1), m.end(1), rng.choice([o for o in ARITH if o != m.group(1)])))
    for m in _COMPARE_RE.finditer(body):
        sites.append((m.start(1), m.end(1), rng.choice([o for o in COMPARE if o != m.group(1)])))
    for m in _INT_RE.finditer(body):
        sites.append((m.start(), m.end(), str(int(m.group()) + rng.choice((-1, 1)))))
    for m in _NAME_RE.finditer(body):
        others = [n for n in names if n != m.group()]
        if m.group() in names and others:
            sites.append((m.start(), m.end(), rng.choice(others)))
    if not sites:
        return {}
    start, end, text = rng.choice(sites)
    return {path: head + body[:start] + text + body[end:]}


BASELINES = ("unmodified", "docstring_rule", "random_edit")


def patch_of(baseline: str, code: CodeTask, seed: int = 0) -> dict[str, str]:
    """The patch `baseline` (one of BASELINES) writes for `code`."""
    if baseline == "unmodified":
        return unmodified(code)
    if baseline == "docstring_rule":
        return docstring_rule(code)
    if baseline == "random_edit":
        return random_edit(code, seed)
    raise ValueError(f"unknown baseline {baseline!r}; expected one of {BASELINES}")
