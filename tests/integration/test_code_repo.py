"""Repository tasks: seeded bugs planted in toolz, kept only where toolz's own tests catch them.

The generator (libs/envs code/repo.py) is checked against real sandboxes: the shipped catalogue is
what a fresh survey finds, each sampled mutant fails its graded tests and the reference fix
passes them, and edits to the package's own tests are ignored by grading.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from slipstream.engine import ByteTokenizer, SamplingParams
from slipstream.envs import TaskSpec, get_env
from slipstream.envs.code import repo
from slipstream.envs.code.tasks import task_of_key
from slipstream.harness import rollout_episodes
from slipstream.sandbox import cgroups
from slipstream.supervised import ScriptedEngine

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(cgroups.available() is not None, reason=f"no cgroups here: {cgroups.available()}"),
]

TOK = ByteTokenizer()


def test_sites_are_deterministic_and_each_mutant_changes_one_token() -> None:
    source = repo.package_files()[repo.module_path("itertoolz")]
    sites = repo.sites("itertoolz")
    assert len(sites) == 79 and sites == repo.sites.__wrapped__("itertoolz")  # type: ignore[attr-defined]
    for site in sites[:20]:
        mutated = repo.mutate(source, site)
        before, after = source.splitlines(), mutated.splitlines()
        changed = [i for i, (x, y) in enumerate(zip(before, after, strict=True)) if x != y]
        assert changed == [site.line - 1]
        assert (
            after[site.line - 1]
            == before[site.line - 1][: site.col] + site.new + before[site.line - 1][site.col + len(site.old) :]
        )


def test_the_catalogue_matches_the_installed_package() -> None:
    catalogue = repo.catalogue()
    assert len(catalogue) == 73  # of 92 sites: 8 + 7 missed by the tests, 4 hung (see the README)
    for key, entry in catalogue.items():
        _, module, index = key.split(":")
        assert tuple(entry["site"]) == repo.sites(module)[int(index)]
        # Graded by the failing tests (at most MAX_FAILING) and up to PASSING that pass on the mutant.
        assert entry["failing"] and set(entry["failing"][: repo.MAX_FAILING]) <= set(entry["tests"])
        assert len(set(entry["tests"]) - set(entry["failing"])) <= repo.PASSING


def test_a_fresh_survey_finds_what_the_catalogue_holds() -> None:
    fresh = repo.survey(("dicttoolz", "recipes"))
    shipped = {k: v for k, v in repo.catalogue().items() if k.split(":")[1] in ("dicttoolz", "recipes")}
    assert {m["key"]: m for m in fresh["mutants"]} == shipped
    assert fresh["counts"] == {
        "dicttoolz": {"sites": 12, "caught": 5, "missed": 7, "hung": 0},
        "recipes": {"sites": 1, "caught": 1, "missed": 0, "hung": 0},
    }


@pytest.mark.parametrize("key", sorted(random.Random(14).sample(repo.repo_keys(), 4)))
def test_the_planted_bug_fails_its_tests_and_the_reference_fix_passes(key: str) -> None:
    env = get_env("code", source="repo")
    task = spec(key)
    ref = json.loads(task.reference)
    code = task_of_key(key)
    broken = env.score(task, "{}")
    assert not broken.correct and broken.parse_ok
    fixed_file = code.files[ref["path"]].replace(ref["old"], ref["new"], 1)
    fixed = env.score(task, json.dumps({ref["path"]: fixed_file}))
    n = len(repo.catalogue()[key]["tests"])
    assert fixed.correct and fixed.reason == f"{n}/{n} tests passed"


def test_grading_ignores_edits_to_the_packages_own_tests() -> None:
    env = get_env("code", source="repo")
    key = repo.repo_keys()[0]
    task = spec(key)
    code = task_of_key(key)
    gutted = "def test_accumulate():\n    pass\n"
    patch = {"toolz/tests/test_itertoolz.py": gutted, "test_task.py": "def test_ok():\n    pass\n"}
    score = env.score(task, json.dumps(patch))
    assert not score.correct and "ignored edits to protected" in score.reason
    assert "toolz/tests/test_itertoolz.py" in code.protected_paths


def test_the_expert_fixes_a_repository_task_through_the_harness() -> None:
    env = get_env("code", source="repo")
    (task,) = env.generate("train", 1, seed=3)
    engine = ScriptedEngine(TOK, lambda _, context: env.expert(task, context))
    (episode,) = asyncio.run(
        rollout_episodes(engine, TOK, env, task, group_size=1, params=SamplingParams(temperature=0.0, max_tokens=512))
    )
    assert [e.name for e in episode.tool_log] == ["replace", "run_tests"]
    assert episode.tool_log[1].result.endswith("passed, 0 failed")
    assert env.score(task, episode).correct


def spec(key: str) -> TaskSpec:
    """The TaskSpec of a repository task `key` (what `generate` makes, for a chosen key)."""
    code = task_of_key(key)
    meta = {"key": key}
    return TaskSpec(
        task_id=f"code-{key}",
        env="code",
        prompt=code.prompt,
        reference=code.reference,
        seed=0,
        split="train",
        metadata=meta,
    )
