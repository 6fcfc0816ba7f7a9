"""`programs`: thousands of small buggy functions from a grammar, held out by program template (issue 34).

A task is one short function in `ops.py` with a docstring stating what it computes, one planted bug,
three visible tests (the first fails; its assertion is in the prompt) and hidden cases the grader
may add. The grammar has 14 function **shapes** (arithmetic over one or two arguments, comparisons,
conditionals, loops over a range or a list with an accumulator, string slicing and joining, guards
for a missing case); each shape draws its function name, argument names, operators and constants.
A shape admits some of six **bug kinds**: `wrong_operator`, `off_by_one`, `wrong_comparison`,
`wrong_variable`, `missing_case`, `swapped_args`. The fix is one short replace (old and new snippets
of at most 44 characters together, so the call fits a 128-token turn), readable from the docstring
and the failing assertion; a fixed docstring-word rule only solves the wrong-operator kind.

**Template** = `<shape>.<bug kind>`. The key is `programs:<shape>.<bug>:<n>` and the split is a
function of the template alone: the held-out templates (`HELDOUT_TEMPLATES`) never occur in train.
Every shape and every bug kind still occurs in train (on other combinations), so held-out asks for
a known bug kind fixed in a known shape it was never paired with.

For the grader: `reference(key)` is the fixed module's source, `entry_point(key)` the function's
name and `hidden_cases(key)` extra `(args, expected)` pairs (none among the visible tests).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

PREFIX = "programs"
PATH = "ops.py"
TEST_PATH = "test_ops.py"
BUG_KINDS = ("wrong_operator", "off_by_one", "wrong_comparison", "wrong_variable", "missing_case", "swapped_args")
MAX_SNIPPETS = 44  # old + new characters, JSON-escaped: a replace call of 82 + 44 bytes fits 128 tokens
VISIBLE = 3
HIDDEN = 6
TOOLS_LINE = "tools: read_file, search, create_file, replace, run, run_tests\n"

Args = tuple[Any, ...]


@dataclass(frozen=True)
class Draft:
    """One drawn program: its signature, docstring, fixed body and, per bug kind, (good, bad, guess)
    snippets: `good` occurs once in the fixed source, `bad` replaces it, `guess` is a plausible
    wrong fix (the imperfect expert's)."""

    name: str
    params: tuple[str, ...]
    doc: str
    body: str  # indented lines after the docstring
    bugs: dict[str, tuple[str, str, str]]
    inputs: Callable[[random.Random], Args]

    def source(self) -> str:
        return f'def {self.name}({", ".join(self.params)}):\n    """{self.doc}"""\n{self.body}'


def _ints(lo: int, hi: int, n: int) -> Callable[[random.Random], Args]:
    return lambda r: tuple(r.randint(lo, hi) for _ in range(n))


_PAIRS = (("a", "b"), ("x", "y"), ("m", "n"), ("p", "q"), ("u", "v"))
_ONES = ("x", "n", "k", "v", "z")
_MEANING = {"+": "sum", "-": "difference", "*": "product"}
_OTHER = {"+": "-", "-": "+", "*": "+"}  # a wrong operator a hasty fix reaches for
_AFFINE = {"+": "plus", "-": "minus", "*": "times"}


def _arith(r: random.Random) -> Draft:
    a, b = r.choice(_PAIRS)
    op = r.choice("+-*")
    wrong, other = r.sample([o for o in "+-*" if o != op], 2)
    expr = f"{a} {op} {b}"
    return Draft(
        r.choice(("combine", "mix", "merge", "blend", "fold", "pair")),
        (a, b),
        f"The {_MEANING[op]} of {a} and {b}.",
        f"    return {expr}\n",
        {
            "wrong_operator": (expr, f"{a} {wrong} {b}", f"{a} {other} {b}"),
            "wrong_variable": (expr, f"{a} {op} {a}", f"{b} {op} {b}"),
        },
        _ints(2, 9, 2),
    )


_NONCOMM = {
    "-": "{a} minus {b}.",
    "//": "{a} divided by {b}, rounded down.",
    "%": "The remainder of {a} divided by {b}.",
}


def _noncomm(r: random.Random) -> Draft:
    a, b = r.choice(_PAIRS)
    op = r.choice(tuple(_NONCOMM))
    wrong = r.choice([o for o in ("-", "//", "%", "+") if o != op])
    expr = f"{a} {op} {b}"
    doc = _NONCOMM[op].format(a=a, b=b)
    return Draft(
        r.choice(("take", "split", "cut", "part", "share", "drop")),
        (a, b),
        doc,
        f"    return {expr}\n",
        {
            "swapped_args": (expr, f"{b} {op} {a}", f"{b} {op} {b}"),
            "wrong_operator": (expr, f"{a} {wrong} {b}", f"{a} * {b}"),
        },
        lambda rr: (rr.randint(10, 40), rr.randint(2, 7)),
    )


def _affine(r: random.Random) -> Draft:
    x = r.choice(_ONES)
    op = r.choice("+-*")
    k = r.randint(3, 9)
    wrong, other = r.sample([o for o in "+-*" if o != op], 2)
    return Draft(
        r.choice(("step", "shift", "scale", "bump", "nudge", "adjust")),
        (x,),
        f"{x} {_AFFINE[op]} {k}.",
        f"    return {x} {op} {k}\n",
        {
            "wrong_operator": (f"{x} {op} {k}", f"{x} {wrong} {k}", f"{x} {other} {k}"),
            "off_by_one": (f"{op} {k}", f"{op} {k + 1}", f"{op} {k + 2}"),
        },
        _ints(2, 20, 1),
    )


def _pick(r: random.Random) -> Draft:
    a, b = r.choice(_PAIRS)
    cmp, word = r.choice(((">", "larger"), ("<", "smaller")))
    flip = "<" if cmp == ">" else ">"
    return Draft(
        r.choice(("pick", "choose", "best", "select", "prefer", "keep")),
        (a, b),
        f"The {word} of {a} and {b}.",
        f"    return {a} if {a} {cmp} {b} else {b}\n",
        {
            "wrong_comparison": (f"{a} {cmp} {b}", f"{a} {flip} {b}", f"{a} == {b}"),
            "wrong_variable": (f"else {b}", f"else {a}", "else 0"),
        },
        lambda rr: tuple(rr.sample(range(0, 30), 2)),
    )


def _clamp(r: random.Random) -> Draft:
    x = r.choice(_ONES)
    k = r.randint(2, 9)
    cmp, word = r.choice(((">", "at least"), ("<", "at most")))
    flip = "<" if cmp == ">" else ">"
    return Draft(
        r.choice(("clamp", "bound", "limit", "floor", "cap", "guard")),
        (x,),
        f"{x}, but {word} {k}.",
        f"    return {x} if {x} {cmp} {k} else {k}\n",
        {
            "wrong_comparison": (f"{x} {cmp} {k}", f"{x} {flip} {k}", f"{x} == {k}"),
            "off_by_one": (f"else {k}", f"else {k + 1}", f"else {k - 1}"),
        },
        _ints(0, 14, 1),
    )


def _total(r: random.Random) -> Draft:
    n = r.choice(("n", "m", "top", "end"))
    acc = r.choice(("t", "s", "acc", "total"))
    i = r.choice(("i", "j", "k"))
    start = r.randint(0, 3)
    square = r.random() < 0.5
    term = f"{i} * {i}" if square else i
    what = "squares of the whole numbers" if square else "whole numbers"
    return Draft(
        r.choice(("total", "series", "tally", "upto", "running", "sweep")),
        (n,),
        f"The sum of the {what} from {start} to {n}.",
        f"    {acc} = 0\n    for {i} in range({start}, {n} + 1):\n        {acc} += {term}\n    return {acc}\n",
        {
            "off_by_one": (f", {n} + 1)", f", {n})", f", {n} + 2)"),
            "wrong_variable": (f"{acc} += {term}", f"{acc} += {n}", f"{acc} += 1"),
            "wrong_operator": (f"{acc} += ", f"{acc} -= ", f"{acc} *= "),
        },
        lambda rr: (rr.randint(start + 2, 12),),
    )


_COUNT = {">": "greater than", "<": "less than", ">=": "at least", "<=": "at most"}
_FLIP = {">": "<", "<": ">", ">=": "<=", "<=": ">="}
_STRICT = {">": ">=", ">=": ">", "<": "<=", "<=": "<"}


def _list_of(rr: random.Random) -> list[int]:
    return [rr.randint(0, 9) for _ in range(rr.randint(3, 6))]


def _count_if(r: random.Random) -> Draft:
    xs, v, k = r.choice((("xs", "v", "k"), ("data", "x", "t"), ("vals", "e", "lim"), ("nums", "n", "cut")))
    cmp = r.choice(tuple(_COUNT))
    c = r.choice(("c", "found", "hits"))
    return Draft(
        r.choice(("count", "how_many", "above", "tally_if", "census", "number")),
        (xs, k),
        f"How many items of {xs} are {_COUNT[cmp]} {k}.",
        f"    {c} = 0\n    for {v} in {xs}:\n        if {v} {cmp} {k}:\n            {c} += 1\n    return {c}\n",
        {
            "wrong_comparison": (f"{v} {cmp} {k}", f"{v} {_FLIP[cmp]} {k}", f"{v} == {k}"),
            "off_by_one": (f"{v} {cmp} {k}", f"{v} {_STRICT[cmp]} {k}", f"{v} != {k}"),
            "swapped_args": (f"{v} {cmp} {k}", f"{k} {cmp} {v}", f"{k} == {v}"),
        },
        lambda rr: (_list_of(rr), rr.randint(1, 8)),
    )


def _sum_list(r: random.Random) -> Draft:
    xs, v = r.choice((("xs", "v"), ("items", "x"), ("vals", "e"), ("nums", "n")))
    acc = r.choice(("t", "s", "acc", "total"))
    square = r.random() < 0.5
    term = f"{v} * {v}" if square else v
    what = "squares of the items" if square else "items"
    return Draft(
        r.choice(("add_up", "summed", "accumulate", "grand", "pool", "gather")),
        (xs,),
        f"The sum of the {what} of {xs}.",
        f"    {acc} = 0\n    for {v} in {xs}:\n        {acc} += {term}\n    return {acc}\n",
        {
            "wrong_variable": (f"{acc} += {term}", f"{acc} += {acc}", f"{acc} += 1"),
            "wrong_operator": (f"{acc} += ", f"{acc} -= ", f"{acc} *= "),
            "off_by_one": (f"{acc} = 0", f"{acc} = 1", f"{acc} = -1"),
        },
        lambda rr: (_list_of(rr),),
    )


def _slice(r: random.Random) -> Draft:
    s, n = r.choice((("s", "n"), ("text", "k"), ("word", "i"), ("line", "m")))
    kind = r.randrange(3)
    expr, doc = ((f"{s}[:{n}]", "The first {n} characters of {s}."), (f"{s}[-{n}:]", "The last {n} characters of {s}."),
                 (f"{s}[{n}:]", "{s} without its first {n} characters."))[kind]  # fmt: skip
    inner = expr[len(s) + 1 : -1]  # ":n", "-n:", "n:"
    bad = inner.replace(n, f"{n} + 1")
    guess = inner.replace(n, f"{n} - 1")
    doc = doc.format(s=s, n=n)
    return Draft(
        r.choice(("head", "tail", "trim", "clip", "snip", "part")),
        (s, n),
        doc,
        f"    return {expr}\n",
        {"off_by_one": (f"[{inner}]", f"[{bad}]", f"[{guess}]")},
        lambda rr: ("".join(rr.choice("abcdefgh") for _ in range(rr.randint(4, 7))), rr.randint(1, 3)),
    )


def _concat(r: random.Random) -> Draft:
    s, t = r.choice((("s", "t"), ("a", "b"), ("left", "right"), ("head", "tail")))
    sep = r.choice(("-", "+", "/", ":", " "))
    expr = f'{s} + "{sep}" + {t}'
    return Draft(
        r.choice(("join", "glue", "link", "chain", "attach", "couple")),
        (s, t),
        f'{s} and {t} joined by "{sep}".',
        f"    return {expr}\n",
        {
            "swapped_args": (expr, f'{t} + "{sep}" + {s}', f'{t} + "{sep}" + {t}'),
            "wrong_variable": (f'" + {t}', f'" + {s}', f'" + "{sep}"'),
        },
        lambda rr: tuple("".join(rr.choice("abcdefgh") for _ in range(rr.randint(1, 4))) for _ in range(2)),
    )


def _safe_div(r: random.Random) -> Draft:
    a, b = r.choice(_PAIRS)
    op, what = r.choice((("//", "{a} divided by {b}, rounded down"), ("%", "The remainder of {a} divided by {b}")))
    what = what.format(a=a, b=b)
    return Draft(
        r.choice(("ratio", "per", "quota", "portion", "safe_div", "rate")),
        (a, b),
        f"{what}; 0 when {b} is 0.",
        f"    return {a} {op} {b} if {b} else 0\n",
        {
            "missing_case": (f"{a} {op} {b} if {b} else 0", f"{a} {op} {b}", f"{a} {op} {b} if {a} else 0"),
            "swapped_args": (f"{a} {op} {b} if", f"{b} {op} {a} if", f"{a} {op} {a} if"),
        },
        lambda rr: (rr.randint(10, 40), rr.choice((0, 0, 2, 3, 4, 5, 7))),
    )


def _divisible(r: random.Random) -> Draft:
    n = r.choice(_ONES)
    k = r.randint(3, 8)
    return Draft(
        r.choice(("divides", "multiple", "even_in", "fits", "whole", "evenly")),
        (n,),
        f"Whether {n} is divisible by {k}.",
        f"    return {n} % {k} == 0\n",
        {
            "wrong_comparison": ("== 0", "!= 0", "> 0"),
            "off_by_one": (f"% {k} ", f"% {k + 1} ", f"% {k - 1} "),
        },
        lambda rr: (rr.choice((k, 2 * k, 3 * k, rr.randint(1, 40))),),
    )


def _end_item(r: random.Random) -> Draft:
    xs = r.choice(("xs", "items", "vals", "nums"))
    first = r.random() < 0.5
    idx, nxt, word = ("0", "1", "first") if first else ("-1", "-2", "last")
    return Draft(
        r.choice(("front", "back", "edge", "end", "peek", "top")),
        (xs,),
        f"The {word} item of {xs}, or 0 if {xs} is empty.",
        f"    return {xs}[{idx}] if {xs} else 0\n",
        {
            "missing_case": (f"{xs}[{idx}] if {xs} else 0", f"{xs}[{idx}]", f"{xs}[{idx}] if {xs} else 1"),
            "off_by_one": (f"[{idx}]", f"[{nxt}]", f"[{int(nxt) + (1 if first else -1)}]"),
        },
        lambda rr: (rr.choice(([], [], *([_list_of(rr)] * 4))),),
    )


def _sign(r: random.Random) -> Draft:
    x = r.choice(_ONES)
    return Draft(
        r.choice(("sign", "direction", "polarity", "sgn", "signum", "side")),
        (x,),
        f"1 if {x} is positive, -1 if negative, else 0.",
        f"    return 1 if {x} > 0 else -1 if {x} < 0 else 0\n",
        {
            "missing_case": (f"else -1 if {x} < 0 else 0", "else -1", f"else -1 if {x} > 0 else 0"),
            "wrong_comparison": (f"-1 if {x} < 0", f"-1 if {x} > 0", f"-1 if {x} == 0"),
        },
        lambda rr: (rr.choice((0, 0, rr.randint(-9, 9))),),
    )


SHAPES: dict[str, Callable[[random.Random], Draft]] = {
    "arith": _arith,
    "noncomm": _noncomm,
    "affine": _affine,
    "pick": _pick,
    "clamp": _clamp,
    "total": _total,
    "count_if": _count_if,
    "sum_list": _sum_list,
    "slice": _slice,
    "concat": _concat,
    "safe_div": _safe_div,
    "divisible": _divisible,
    "end_item": _end_item,
    "sign": _sign,
}


@cache
def templates() -> tuple[str, ...]:
    """Every `<shape>.<bug kind>` the grammar admits (the bug kinds of a shape's first draw)."""
    return tuple(f"{shape}.{bug}" for shape, make in SHAPES.items() for bug in make(random.Random(0)).bugs)


# Held out: one shape-bug combination for 9 of the 14 shapes, chosen so that every bug kind and every
# shape still occurs in train on other combinations. Fixed by name (not hashed) so the split is
# readable and cannot drift with the grammar.
HELDOUT_TEMPLATES = frozenset(
    {
        "arith.wrong_variable",
        "noncomm.swapped_args",
        "affine.off_by_one",
        "pick.wrong_comparison",
        "total.wrong_operator",
        "count_if.off_by_one",
        "concat.wrong_variable",
        "safe_div.missing_case",
        "divisible.wrong_comparison",
    }
)


def template_of(key: str) -> str:
    """`programs:<shape>.<bug>:<n>` -> `<shape>.<bug>`; a clear error for anything else."""
    prefix, _, rest = key.partition(":")
    template, _, number = rest.partition(":")
    if prefix != PREFIX or template not in templates() or not number.isdigit():
        raise KeyError(f"not a programs task key: {key!r} (programs:<shape>.<bug>:<n>, templates {templates()})")
    return template


def split_of(key: str) -> str:
    """`heldout` for a held-out template, else `train`: a function of the template, never of the key's number."""
    return "heldout" if template_of(key) in HELDOUT_TEMPLATES else "train"


def sample_key(rng: random.Random) -> str:
    """A key of either split: a template drawn uniformly, then a number."""
    all_templates = templates()
    return f"{PREFIX}:{all_templates[rng.randrange(len(all_templates))]}:{rng.randrange(10**6)}"


@dataclass(frozen=True)
class Program:
    """A built task: the buggy and fixed sources, the replace that fixes it, visible and hidden cases."""

    key: str
    template: str
    name: str
    buggy: str
    fixed: str
    old: str
    new: str
    guess: str
    visible: tuple[tuple[Args, Any], ...]
    hidden: tuple[tuple[Args, Any], ...]


def _function(source: str, name: str) -> Callable[..., Any]:
    scope: dict[str, Any] = {}
    exec(compile(source, PATH, "exec"), scope)  # our own generated source, never the agent's
    fn: Callable[..., Any] = scope[name]
    return fn


def _outcome(fn: Callable[..., Any], args: Args) -> Any:
    try:
        return ("ok", fn(*[list(a) if isinstance(a, list) else a for a in args]))
    except Exception as exc:  # the buggy version may divide by zero
        return ("raised", type(exc).__name__)


def sources(key: str) -> tuple[str, str, str, str, str, Draft, random.Random]:
    """(fixed, buggy, good, bad, guess) snippets of `key`, its draft and the rng that drew it (no tests
    built: cheap enough to count thousands of programs)."""
    template = template_of(key)
    shape, _, bug = template.partition(".")
    rng = random.Random(f"{PREFIX}|{key}")
    draft = SHAPES[shape](rng)
    good, bad, guess = draft.bugs[bug]
    fixed = draft.source()
    if fixed.count(good) != 1:
        raise AssertionError(f"{key}: snippet {good!r} is not unique in {fixed!r}")
    buggy = fixed.replace(good, bad)
    if buggy.count(bad) != 1:
        raise AssertionError(f"{key}: snippet {bad!r} is not unique in {buggy!r}")
    return fixed, buggy, good, bad, guess, draft, rng


@lru_cache(maxsize=4096)
def program(key: str) -> Program:
    """The task of `key`, a pure function of it."""
    fixed, buggy, good, bad, guess, draft, rng = sources(key)
    right, wrong = _function(fixed, draft.name), _function(buggy, draft.name)
    failing: list[tuple[Args, Any]] = []
    passing: list[tuple[Args, Any]] = []
    seen: set[str] = set()
    for _ in range(400):
        args = draft.inputs(rng)
        tag = repr(args)
        if tag in seen:
            continue
        seen.add(tag)
        status, want = _outcome(right, args)
        if status != "ok":
            raise AssertionError(f"{key}: the reference raised on {args!r}")
        (failing if _outcome(wrong, args) != ("ok", want) else passing).append((args, want))
        if len(failing) >= 4 and len(failing) + len(passing) >= VISIBLE + HIDDEN:
            break
    if not failing or len(failing) + len(passing) < VISIBLE + 2:
        raise AssertionError(f"{key}: the bug is not caught by the drawn inputs")
    # Visible: a failing case first (the prompt's), then a passing one when there is one and a second
    # failing one when there is one (a bug at a single edge, the empty list or zero, fails once);
    # hidden: the rest, failing ones first, each distinct from the visible.
    visible = [failing[0], *passing[:1], *failing[1:2]]
    visible += [c for c in failing + passing if c not in visible][: VISIBLE - len(visible)]
    rest = [c for c in failing + passing if c not in visible]
    guess_src = fixed.replace(good, guess)
    if guess_src == fixed or all(_outcome(_function(guess_src, draft.name), a) == ("ok", w) for a, w in visible):
        guess = bad  # a guess that happens to be right would not be a guess: the no-op edit instead
    return Program(
        key=key,
        template=template_of(key),
        name=draft.name,
        buggy=buggy,
        fixed=fixed,
        old=bad,
        new=good,
        guess=guess,
        visible=tuple(visible),
        hidden=tuple(rest[:HIDDEN]),
    )


def _call(name: str, args: Args) -> str:
    return f"{name}({', '.join(repr(a) for a in args)})"


def test_source(name: str, cases: tuple[tuple[Args, Any], ...]) -> str:
    """The visible test file: one `test_<name>_<i>` per case, plain asserts (the runner needs no pytest)."""
    body = "".join(
        f"def test_{name}_{i}():\n    assert {_call(name, args)} == {want!r}\n\n\n"
        for i, (args, want) in enumerate(cases)
    )
    return (f"from ops import {name}\n\n\n" + body).rstrip() + "\n"


def prompt_of(p: Program) -> str:
    args, want = p.visible[0]
    return f"fix {PATH}\n{PATH}:\n{p.buggy}failing: assert {_call(p.name, args)} == {want!r}\n{TOOLS_LINE}"


def reference_patch(p: Program) -> str:
    """The task's reference JSON (what `CodeTask.reference` carries): key, the fixing replace, the guess."""
    return json.dumps({"key": p.key, "path": PATH, "old": p.old, "new": p.new, "guess": p.guess})


# -- for the grader ------------------------------------------------------------------------------------


def reference(key: str) -> str:
    """The fixed `ops.py` of `key` (passes every visible and hidden case)."""
    return program(key).fixed


def entry_point(key: str) -> str:
    """The name of the function under test in `ops.py`."""
    return program(key).name


def hidden_cases(key: str) -> list[tuple[Args, Any]]:
    """Extra `(args, expected)` pairs, none of them among the visible tests; args are plain Python
    values (ints, strings, lists of ints), expected is the reference's return value."""
    return [(args, want) for args, want in program(key).hidden]
