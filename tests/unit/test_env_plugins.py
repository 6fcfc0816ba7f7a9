"""Environment plugins: packages that register environments through the `slipstream.environments`
entry points, found by name and imported only when named, and every way one can be wrong."""

from __future__ import annotations

import importlib.metadata
import random
import sys
import types
from pathlib import Path
from typing import Any

import msgspec
import pytest

from slipstream.envs import EnvError, Environment, Problem, Score, TaskSpec, get_env, registry

pytestmark = pytest.mark.unit


class _Opts(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    width: int = 2


class Echo(Environment[_Opts]):
    """A plugin's environment, not registered by its module: the entry point names it."""

    Options = _Opts
    components = ("correct",)

    def sample(self, rng: random.Random) -> Problem:
        word = str(rng.randrange(10**self.options.width))
        return Problem(key=word, prompt=f"echo {word}=", reference=word)

    def grade(self, task: TaskSpec, completion: str) -> Score:
        ok = completion.partition("\n")[0] == task.reference
        return Score.of({"correct": float(ok)}, correct=ok, parse_ok=True, reason="")


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Fake installed plugins ({entry-point name: value}) in place of the real ones, and a scratch registry."""
    plugins: dict[str, str] = {}
    monkeypatch.setattr(registry, "ENVIRONMENTS", dict(registry.ENVIRONMENTS))

    def entry_points(*, group: str) -> list[importlib.metadata.EntryPoint]:
        assert group == registry.PLUGIN_GROUP
        return [importlib.metadata.EntryPoint(name, value, group) for name, value in plugins.items()]

    monkeypatch.setattr(registry.importlib.metadata, "entry_points", entry_points)
    module = types.ModuleType("fake_plugin")
    module.Echo = Echo  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_plugin", module)
    monkeypatch.setattr(Echo, "name", "")
    return plugins


def test_the_example_package_is_installed_and_found_by_name() -> None:
    # examples/plugin-env, installed by `make install`: nothing in libs/envs names it.
    assert registry.plugins()["sort"] == "slipstream-sort-env (slipstream_sort:Sort)"
    env = get_env("sort", length=4)
    assert type(env).__module__ == "slipstream_sort" and env.name == "sort"
    task = env.generate("heldout", 1, seed=5)[0]
    assert sorted(task.prompt[5:-1]) == list(task.reference) and len(task.reference) == 4
    assert env.score(task, task.reference + "\n").reward == pytest.approx(1.1)
    assert "sort" in registry.available() and "sort" in registry.task_envs()


def test_a_plugin_is_imported_only_when_named_and_registered_under_its_entry_point(installed: dict[str, str]) -> None:
    installed["echo"] = "fake_plugin:Echo"
    assert "echo" not in registry.ENVIRONMENTS and "echo" in registry.available()
    env = get_env("echo", width=3)
    assert isinstance(env, Echo) and Echo.name == "echo" and registry.ENVIRONMENTS["echo"] is Echo
    assert [len(t.reference) <= 3 for t in env.generate("train", 4, seed=1)] == [True] * 4
    assert get_env("echo").options == _Opts(width=2)  # the second lookup finds the registered class


def test_a_plugin_that_fails_to_import_is_an_error_naming_it_and_the_cause(installed: dict[str, str]) -> None:
    installed["broken"] = "no_such_module_xyz:Env"
    installed["echo"] = "fake_plugin:Echo"
    with pytest.raises(EnvError) as info:
        get_env("broken")
    assert str(info.value) == (
        "environment 'broken': its plugin ? (no_such_module_xyz:Env) failed to import: "
        "ModuleNotFoundError: No module named 'no_such_module_xyz'"
    )
    # Only the runs that name it break: the others, and the list of task environments, still work.
    assert "echo" in registry.task_envs() and "broken" not in registry.task_envs()
    assert get_env("arith").name == "arith"


def test_a_plugin_that_registers_nothing_or_another_name_is_an_error(installed: dict[str, str]) -> None:
    installed["empty"] = "fake_plugin"  # a module whose import registers no environment
    with pytest.raises(EnvError, match=r"plugin \? \(fake_plugin\): loading it registered no environment 'empty'"):
        get_env("empty")
    Echo.name = "echo"
    installed["other"] = "fake_plugin:Echo"
    with pytest.raises(EnvError, match=r"entry point 'other' names Echo, registered as 'echo'"):
        get_env("other")


def test_two_plugins_claiming_one_name_and_bad_names_are_errors(
    installed: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    installed["Bad Name"] = "fake_plugin:Echo"
    with pytest.raises(EnvError, match=r"environment name 'Bad Name' must match"):
        get_env("Bad Name")
    eps = [
        importlib.metadata.EntryPoint("echo", "fake_plugin:Echo", registry.PLUGIN_GROUP),
        importlib.metadata.EntryPoint("echo", "other_plugin:Echo", registry.PLUGIN_GROUP),
    ]

    def twice(*, group: str) -> list[Any]:
        return eps

    monkeypatch.setattr(registry.importlib.metadata, "entry_points", twice)
    with pytest.raises(EnvError, match=r"'echo' is claimed by two plugins: \? \(fake_plugin:Echo\) and \? \(other"):
        get_env("echo")


def test_an_unknown_name_lists_builtins_and_plugins(installed: dict[str, str]) -> None:
    installed["echo"] = "fake_plugin:Echo"
    with pytest.raises(EnvError, match=r"unknown environment 'nope'; known: arith, .*echo, .*reverse"):
        get_env("nope")


def test_the_readme_how_to_is_the_example_package() -> None:
    # libs/envs README, "Write your own environment": the whole module, as shipped and tested.
    repo = Path(__file__).resolve().parents[2]
    readme = (repo / "libs" / "envs" / "README.md").read_text()
    block = readme.split("# examples/plugin-env/src/slipstream_sort/__init__.py\n", 1)[1].split("```", 1)[0]
    assert block == (repo / "examples" / "plugin-env" / "src" / "slipstream_sort" / "__init__.py").read_text()
    assert len(block.splitlines()) < 50 and 'sort = "slipstream_sort:Sort"' in readme
