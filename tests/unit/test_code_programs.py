"""The `programs` task generator (code/programs.py): diversity, the split by template, tasks that are
fixable and caught by their tests, and the expert's guesses. No sandbox: the functions run in-process."""

from __future__ import annotations

import json
import random

import pytest

from slipstream.envs import get_env
from slipstream.envs.code import programs as P
from slipstream.envs.code.tasks import task_of_key


def _run(source: str, name: str, args: tuple) -> object:
    scope: dict = {}
    exec(source, scope)
    try:
        return ("ok", scope[name](*args))
    except Exception as exc:
        return ("raised", type(exc).__name__)


def test_the_grammar_has_its_templates_and_the_held_out_ones_leave_every_shape_and_bug_kind_in_train() -> None:
    templates = P.templates()
    assert len(templates) == 30 and len(set(templates)) == 30
    assert P.HELDOUT_TEMPLATES.issubset(templates) and len(P.HELDOUT_TEMPLATES) == 9
    train = set(templates) - P.HELDOUT_TEMPLATES
    assert {t.split(".")[0] for t in train} == set(P.SHAPES)
    assert {t.split(".")[1] for t in train} == set(P.BUG_KINDS)
    assert {t.split(".")[1] for t in P.HELDOUT_TEMPLATES} == set(P.BUG_KINDS)  # each kind held out somewhere


def test_thousands_of_distinct_programs() -> None:
    rng = random.Random(0)
    buggy = {P.sources(P.sample_key(rng))[1] for _ in range(4000)}
    assert len(buggy) >= 2500


def test_train_and_held_out_never_share_a_template_over_many_seeds() -> None:
    env = get_env("code", source="programs")
    train: set[str] = set()
    heldout: set[str] = set()
    for seed in range(3):
        train |= {P.template_of(t.metadata["key"]) for t in env.generate("train", 40, seed)}
        heldout |= {P.template_of(t.metadata["key"]) for t in env.generate("heldout", 24, seed)}
    assert train.isdisjoint(heldout)
    assert heldout == P.HELDOUT_TEMPLATES  # 72 held-out tasks reach all 9 templates
    assert len(train) == 21
    # The split is the template's, whatever the number in the key.
    assert {env.split_of(f"programs:arith.wrong_variable:{n}") for n in range(50)} == {"heldout"}
    assert {env.split_of(f"programs:arith.wrong_operator:{n}") for n in range(50)} == {"train"}


@pytest.mark.parametrize("template", P.templates())
def test_every_template_is_caught_by_its_first_test_and_fixed_by_its_reference(template: str) -> None:
    for n in range(3):
        key = f"programs:{template}:{n}"
        p = P.program(key)
        code = task_of_key(key)
        args, want = p.visible[0]
        assert _run(p.buggy, p.name, args) != ("ok", want)  # the prompt's assertion fails on the bug
        assert f"failing: assert {p.name}(" in code.prompt and p.buggy in code.prompt
        ref = json.loads(code.reference)
        assert p.buggy.replace(ref["old"], ref["new"]) == p.fixed == P.reference(key)
        assert len(json.dumps(ref["old"])) + len(json.dumps(ref["new"])) - 4 <= P.MAX_SNIPPETS
        for case_args, case_want in (*p.visible, *p.hidden):
            assert _run(p.fixed, p.name, case_args) == ("ok", case_want)
        hidden = P.hidden_cases(key)
        assert len(hidden) >= 2 and not {repr(a) for a, _ in hidden} & {repr(a) for a, _ in p.visible}
        guessed = p.buggy.replace(ref["old"], ref["guess"])
        assert any(_run(guessed, p.name, a) != ("ok", w) for a, w in p.visible)  # a guess never passes
        assert P.entry_point(key) == p.name and code.files["test_ops.py"].count("def test_") == 3


def test_tasks_are_a_function_of_the_key_and_bad_keys_are_named() -> None:
    key = "programs:count_if.swapped_args:77"
    assert task_of_key(key) == task_of_key(key)
    assert task_of_key(key).prompt != task_of_key("programs:count_if.swapped_args:78").prompt
    for bad in ("programs:nope.wrong_operator:1", "programs:arith.off_by_one:1", "programs:arith.wrong_operator:x"):
        with pytest.raises(KeyError, match="not a programs task key"):
            task_of_key(bad)


def test_the_imperfect_expert_writes_the_tasks_own_guess_on_a_fixed_share() -> None:
    env = get_env("code", source="programs", expert_guess_rate=0.4)
    tasks = env.generate("train", 150, seed=3)
    guesses = 0
    for t in tasks:
        ref = json.loads(t.reference)
        first = env.expert(t, t.prompt)
        assert json.dumps(ref["old"])[1:-1] in first
        if json.dumps(ref["new"])[1:-1] not in first.split('"new"')[1]:
            assert json.dumps(ref["guess"])[1:-1] in first.split('"new"')[1]
            guesses += 1
    assert 0.28 < guesses / len(tasks) < 0.52
    perfect = get_env("code", source="programs")
    assert all(json.dumps(json.loads(t.reference)["new"])[1:-1] in perfect.expert(t, t.prompt) for t in tasks)
