"""`python -m slipstream.run.warmstart_many`: several seeds' warm-starts side by side (on a GPU where
there is one), each the version 0 that `slipstream demo` would make for its seed, kept with what
made it so a swarm run started from it (`--init-model`) reports it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from slipstream.cli.__main__ import build_parser
from slipstream.run import swarm_demo, warmstart, warmstart_many

pytestmark = pytest.mark.unit


def test_seed_plan_is_the_demo_arm_plan() -> None:
    """The swarm arm's plan at seed 4 is what `slipstream demo --env swarm --seed 4` trains from."""
    from slipstream.cli.demo import plan_from_args as demo_plan_from_args

    args = build_parser().parse_args(["demo", "--env", "swarm", "--seed", "4"])
    want = swarm_demo.arm_plan(demo_plan_from_args(args), "swarm")
    got = warmstart_many.seed_plan("swarm", "swarm", 4, None)
    assert msgspec.to_builtins(got) == msgspec.to_builtins(want)
    single = warmstart_many.seed_plan("swarm", "single", 4, 100)
    assert single.env_options["mode"] == "single" and single.sft_steps == 100 and single.sft_settle_steps == 0


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--seeds", "1,x", "--out", "o"], "'1,x'"),
        (["--seeds", ",", "--out", "o"], "names no seed"),
    ],
)
def test_bad_arguments_are_named(argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        warmstart_many.main(argv)
    assert exc.value.code == 2 and named in capsys.readouterr().err


def test_cuda_without_a_gpu_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit):
        warmstart_many.main(["--seeds", "0", "--device", "cuda", "--out", "o"])
    assert "sees no GPU" in capsys.readouterr().err


def test_one_seed_end_to_end(tmp_path: Path) -> None:
    """A child process per seed writes the model and figures.json; the swarm demo reads them back
    for a model given with --init-model; a second launch skips the finished seed."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "slipstream.run.warmstart_many", "--env", "lookup", "--seeds", "3"]
    cmd += ["--sft-steps", "1", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "lookup-s3"
    figures = json.loads((out / "figures.json").read_text())
    assert figures["seed"] == 3 and figures["steps"] == 1 and figures["device"] == "cpu"
    assert "arm" not in figures  # lookup has no swarm arm
    assert figures["torch"] and len(figures["sources"]) == 32
    assert (out / "model" / "config.json").is_file()
    assert "1 steps in" in done.stdout
    made = warmstart.given_figures(out / "model")
    assert made["seed"] == 3 and made["device"] == "cpu" and "made_wall_s" in made and "wall_s" not in made
    assert warmstart.given_figures(tmp_path) == {}
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0 and "already holds a warm-start, skipped" in again.stdout


def test_demo_init_model_reports_what_made_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`slipstream demo --init-model DIR` hands RL the model and the figures warmstart_many left beside
    it (marked given), and names a directory that holds no saved model before anything starts."""
    from slipstream.cli import demo

    model = tmp_path / "search-s1" / "model"
    model.mkdir(parents=True)
    args = build_parser().parse_args(["demo", "--env", "search", "--init-model", str(model)])
    assert demo.run(args) == 2  # no config.json yet
    (model / "config.json").write_text("{}")
    (model.parent / "figures.json").write_text(json.dumps({"seed": 1, "steps": 3000, "wall_s": 3600.0}))
    seen = {}
    monkeypatch.setattr(demo, "execute", lambda plan, args, **kw: seen.update(kw) or 0)
    assert demo.run(args) == 0
    given_dir, given = seen["init_model"]
    assert given_dir == model and given["given"] is True and given["seed"] == 1 and given["made_wall_s"] == 3600.0


def test_code_changed_names_both_digests() -> None:
    """A given model made by other code is named with both digests; the same code, or figures that
    do not say, are not."""
    assert warmstart.code_changed({"sources": "abc"}, sources="abc") == ""
    assert warmstart.code_changed({}, sources="abc") == ""
    why = warmstart.code_changed({"sources": "abc"}, sources="def")
    assert "abc" in why and "def" in why
    assert warmstart.code_changed({"sources": warmstart.source_digest()}) == ""
