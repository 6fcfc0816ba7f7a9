"""The run file's loss keys ([algorithm] kl_coef, kl_estimator, substeps, loss_options) reach the learner's config,
are checked when the file loads, and leave a run without them configured as before; `slipstream demo --kl-coef`."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.run import RunFileError, load, run_env, service_env
from slipstream.runtime.config import resolve

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_kl_substeps_and_loss_options_reach_the_learner(tmp_path: Path) -> None:
    from slipstream.learner.config import LearnerConfig

    path = tmp_path / "kl.toml"
    path.write_text(
        "[algorithm]\n"
        'loss = "kimi"\nkl_coef = 0.05\nkl_estimator = "k1"\nsubsteps = 4\n'
        'loss_options = {off_policy_mask = "sequence", mask_low = 0.25, kimi_tau = 0.2}\n'
    )
    plan = load(path).plan()
    assert (plan.loss, plan.kl_coef, plan.kl_estimator, plan.substeps) == ("kimi", 0.05, "k1", 4)
    cfg = resolve(LearnerConfig, environ=service_env(plan, Path("/m"), Path("/s"), Path("/o.jsonl")))
    loss = cfg.loss
    assert (loss.type, loss.kl_coef, loss.kl_estimator, loss.normalizer) == ("kimi", 0.05, "k1", "tokens")
    assert (loss.off_policy_mask, loss.mask_low, loss.mask_high, loss.kimi_tau) == ("sequence", 0.25, 2.0, 0.2)
    assert cfg.learner.substeps == 4


def test_a_run_without_them_has_the_environment_it_had() -> None:
    env = run_env(load(REPO / "examples" / "reverse.toml").plan())
    assert not [
        k
        for k in env
        if k.startswith("SLIPSTREAM_LOSS__") and k not in ("SLIPSTREAM_LOSS__TYPE", "SLIPSTREAM_LOSS__LOSS_CONSTANT")
    ]
    assert "SLIPSTREAM_LEARNER__SUBSTEPS" not in env


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ('loss_options = {off_policy_mask = "tokens"}', "off_policy_mask"),
        ("loss_options = {mask_lo = 0.5}", "mask_lo"),
        ("kl_coef = -1.0", "kl_coef must be >= 0, got -1.0"),
        ('kl_estimator = "k4"', "kl_estimator"),
        ("substeps = 0", "substeps must be >= 1, got 0"),
    ],
)
def test_a_bad_loss_key_fails_when_the_file_loads(tmp_path: Path, body: str, words: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(f"[algorithm]\n{body}\n")
    with pytest.raises(RunFileError, match=r"bad.toml:\d+: \[algorithm\] .*") as err:
        load(path)
    assert words in str(err.value)


def test_demo_kl_flags_set_the_plan() -> None:
    import argparse

    from slipstream.cli import demo

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    demo.register(sub)
    args = parser.parse_args(["demo", "--kl-coef", "0.02", "--kl-estimator", "k2", "--loss", "kimi"])
    plan = demo.plan_from_args(args)
    assert (plan.kl_coef, plan.kl_estimator, plan.loss) == (0.02, "k2", "kimi")
    assert run_env(plan)["SLIPSTREAM_LOSS__KL_COEF"] == "0.02"
