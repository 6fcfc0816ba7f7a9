"""Trivial code-task policies (code/baselines.py): the docstring rule solves the old bugfix family and
few grammar programs; patches are checked in-process against the tasks' cases (no sandbox)."""

from __future__ import annotations

from slipstream.envs import get_env
from slipstream.envs.code import programs as P
from slipstream.envs.code.baselines import BASELINES, patch_of


def _passes(key: str, patch: dict[str, str]) -> bool:
    p = P.program(key)
    source = patch.get("ops.py", p.buggy)
    scope: dict = {}
    try:
        exec(source, scope)
        return all(scope[p.name](*args) == want for args, want in (*p.visible, *p.hidden))
    except Exception:
        return False


def test_the_docstring_rule_solves_every_old_bugfix_task() -> None:
    env = get_env("code")
    tasks = [env.code_task(t) for t in env.generate("heldout", 24, 7)]
    assert all(patch_of("docstring_rule", c) == {"ops.py": c.meta["fixed"]} for c in tasks)


def test_on_held_out_programs_the_rule_fixes_only_what_a_word_names() -> None:
    env = get_env("code", source="programs")
    tasks = [env.code_task(t) for t in env.generate("heldout", 45, 7)]
    solved = {name: sum(_passes(c.key, patch_of(name, c, 0)) for c in tasks) for name in BASELINES}
    assert solved["unmodified"] == 0
    # The rule's comparison words fix two held-out templates ("larger" -> ">" in pick, "at least" ->
    # ">=" in count_if's strictness bug); no arithmetic one: in "total.wrong_operator" (t -= i under
    # "The sum of ...") the body's first operator is range's "+", already what "sum" names.
    fixed = {P.template_of(c.key) for c in tasks if _passes(c.key, patch_of("docstring_rule", c))}
    assert fixed == {"pick.wrong_comparison", "count_if.off_by_one"}
    assert solved["docstring_rule"] <= 0.3 * len(tasks)
    assert solved["random_edit"] <= 0.2 * len(tasks)
    train = [env.code_task(t) for t in env.generate("train", 45, 7)]
    fixed = {P.template_of(c.key) for c in train if _passes(c.key, patch_of("docstring_rule", c))}
    assert "arith.wrong_operator" in fixed  # it does fix a named arithmetic operator


def test_a_random_edit_changes_one_token_and_is_seeded() -> None:
    env = get_env("code", source="programs")
    for t in env.generate("train", 20, 1):
        code = env.code_task(t)
        first = patch_of("random_edit", code, 0)
        assert first == patch_of("random_edit", code, 0)
        before, after = code.files["ops.py"], first["ops.py"]
        assert before != after and before.splitlines()[:2] == after.splitlines()[:2]
        assert sum(a != b for a, b in zip(before.splitlines(), after.splitlines(), strict=True)) == 1
