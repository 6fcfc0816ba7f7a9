"""A wrong environment, plugin or option in a run file or the demo's flags fails as it loads: one line
naming the file, the line, the bad value and what exists, before anything starts (no traceback)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from slipstream.cli.__main__ import main
from slipstream.envs import registry
from slipstream.run import RunFileError, load

pytestmark = pytest.mark.unit


def _run_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text('name = "x"\nseed = 0\n\n' + body)
    return path


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('[env]\nname = "nope"\n', r"run.toml:5: \[env\] unknown environment 'nope'; known: arith, .*reverse, .*sort"),
        (
            '[env]\nname = "arith"\noptions = { max_operand = 5, colour = "red" }\n',
            r"run.toml:6: \[env\] unknown option\(s\) colour for environment 'arith'; known: max_operand, ops",
        ),
        (
            '[env]\nname = "reverse"\noptions = { min_len = 0 }\n',
            r"run.toml:6: \[env\] bad option for environment 'reverse': need 1 <= min_len <= max_len <= 64",
        ),
        (
            '[env]\nname = "sort"\noptions = { length = "three" }\n',  # a plugin's options are checked alike
            r"run.toml:6: \[env\] bad option for environment 'sort': Expected `int`, got `str` - at `\$.length`",
        ),
        ("[eval]\nsuites = { humaneva = 8 }\n", r"run.toml:5: \[eval\] eval suite 'humaneva': unknown environment"),
    ],
    ids=["name", "unknown-option", "bad-value", "plugin-option", "suite"],
)
def test_a_bad_env_in_a_run_file_is_an_error_naming_it_and_its_line(tmp_path: Path, body: str, expected: str) -> None:
    with pytest.raises(RunFileError, match=expected):
        load(_run_file(tmp_path, body))


def test_a_plugin_that_fails_to_import_fails_the_run_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def entry_points(*, group: str) -> list[importlib.metadata.EntryPoint]:
        return [importlib.metadata.EntryPoint("ghost", "ghost_env_pkg:Ghost", group)]

    monkeypatch.setattr(registry.importlib.metadata, "entry_points", entry_points)
    with pytest.raises(RunFileError) as info:
        load(_run_file(tmp_path, '[env]\nname = "ghost"\n'))
    assert str(info.value) == (
        f"{tmp_path / 'run.toml'}:5: [env] environment 'ghost': its plugin ? (ghost_env_pkg:Ghost) failed to "
        "import: ModuleNotFoundError: No module named 'ghost_env_pkg'"
    )


def test_good_run_files_still_load(tmp_path: Path) -> None:
    run = load(
        _run_file(tmp_path, '[env]\nname = "sort"\noptions = { length = 4 }\n[eval]\nsuites = { humaneval = 2 }\n')
    )
    assert (run.plan().env, run.plan().env_options, run.plan().eval_suites) == ("sort", {"length": 4}, {"humaneval": 2})
    assert load(_run_file(tmp_path, "")).plan().env == "reverse"  # no [env]: the default env is checked


def test_train_print_config_and_demo_say_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _run_file(tmp_path, '[env]\nname = "nope"\n')
    assert main(["train", str(path), "--print-config"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith(
        f"slipstream train: {path}:5: [env] unknown environment 'nope'; known: "
    )
    assert out.err.count("\n") == 1 and "Traceback" not in out.err
    assert main(["demo", "--env", "nope", "--run-dir", str(tmp_path / "run")]) == 2
    out = capsys.readouterr()
    assert out.err.startswith("slipstream demo: unknown environment 'nope'; known: arith, ") and "sort" in out.err
    assert out.err.count("\n") == 1 and not (tmp_path / "run").exists()  # nothing started


def test_the_reasoning_gym_example_is_the_demo_plan() -> None:
    from slipstream.run.presets import demo_plan

    assert load(Path(__file__).resolve().parents[2] / "examples" / "reasoning_gym.toml").plan() == demo_plan(
        "reasoning_gym"
    )
