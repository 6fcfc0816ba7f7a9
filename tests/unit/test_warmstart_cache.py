"""The code demo's warm-start cache (slipstream.run.warmstart): a hit copies the stored model
and figures, and any change to the plan's warm-start or to the code is a miss."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.run import warmstart as wc
from slipstream.run.presets import demo_plan


def _maker(model_dir: Path, calls: list[int], weights: str) -> object:
    def make() -> dict:
        calls.append(1)
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "model.bin").write_text(weights)
        return {"steps": 550, "probe_accuracy": 0.92}

    return make


def test_a_second_identical_warm_start_is_served_from_the_cache(tmp_path: Path) -> None:
    plan = demo_plan("code")
    calls: list[int] = []
    first = wc.cached_warm_start(
        plan, tmp_path / "a", _maker(tmp_path / "a", calls, "w1"), root=tmp_path / "c", sources="s"
    )
    again = wc.cached_warm_start(
        plan, tmp_path / "b", _maker(tmp_path / "b", calls, "w2"), root=tmp_path / "c", sources="s"
    )
    assert calls == [1] and first == {"steps": 550, "probe_accuracy": 0.92}
    assert again["steps"] == 550 and len(again["cached"]) == 32
    assert (tmp_path / "b" / "model.bin").read_text() == "w1"  # the cached model, not a new one
    # A different seed or warm-start field is a different digest: trained afresh.
    plan.seed = 1
    wc.cached_warm_start(plan, tmp_path / "d", _maker(tmp_path / "d", calls, "w3"), root=tmp_path / "c", sources="s")
    plan.seed, plan.sft_lr = 0, 1e-3
    wc.cached_warm_start(plan, tmp_path / "e", _maker(tmp_path / "e", calls, "w4"), root=tmp_path / "c", sources="s")
    assert calls == [1, 1, 1]
    # RL-only fields do not matter to version 0.
    plan.sft_lr, plan.max_steps = demo_plan("code").sft_lr, 7
    hit = wc.cached_warm_start(
        plan, tmp_path / "f", _maker(tmp_path / "f", calls, "w5"), root=tmp_path / "c", sources="s"
    )
    assert calls == [1, 1, 1] and "cached" in hit


def test_the_digest_follows_the_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = demo_plan("code")
    assert wc.plan_digest(plan, "aaa") != wc.plan_digest(plan, "bbb")
    package = tmp_path / "wc_fake_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = wc.source_digest(("wc_fake_pkg",))
    assert wc.source_digest(("wc_fake_pkg",)) == before
    (package / "__init__.py").write_text("X = 2\n")
    assert wc.source_digest(("wc_fake_pkg",)) != before


def test_the_length_penalty_shares_a_warm_start_and_other_options_do_not() -> None:
    """The penalty only shapes RL's reward (the warm-start's probe counts correct answers), so the
    code demo with the penalty on and off starts from one cached model; any other option is a miss."""
    from slipstream.run.presets import with_length_penalty

    on = demo_plan("code")
    off = with_length_penalty(demo_plan("code"), 0.0)
    assert off.env_options["length_penalty"]["scale"] == 0.0 and on.env_options["length_penalty"]["scale"] > 0
    assert wc.plan_digest(on, "s") == wc.plan_digest(off, "s")
    other = demo_plan("code")
    other.env_options = {**other.env_options, "expert_guess_rate": 0.1}
    assert wc.plan_digest(other, "s") != wc.plan_digest(on, "s")
    with pytest.raises(SystemExit, match=r"-0\.5"):
        with_length_penalty(demo_plan("code"), -0.5)


def test_the_default_digest_covers_every_package_that_warm_starts() -> None:
    """The warm-start lives in slipstream.supervised and plays through slipstream.harness: a change in
    either must be a new digest, or a cached model would outlive the code that made it."""
    import importlib.util

    roots = [Path(base) for name in wc.PACKAGES for base in importlib.import_module(name).__path__]
    for module in (
        "slipstream.supervised.warmstart",
        "slipstream.supervised.expert",
        "slipstream.supervised.copying",
        "slipstream.supervised.scripted",
        "slipstream.supervised.sft_set",
        "slipstream.harness.rollout",
        "slipstream.envs.base",
    ):
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin is not None, module
        assert any(Path(spec.origin).is_relative_to(root) for root in roots), f"{module} is outside {wc.PACKAGES}"


@pytest.mark.parametrize(("env", "cached"), [("code", True), ("search", True), ("recall", False)])
def test_initial_model_caches_the_expensive_demos_only(
    env: str, cached: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The code and search demos' cold warm-starts cost 30-60 minutes on 2 cores: `initial_model`
    trains each once per plan and code; a cheap demo's warm-start is trained every time."""
    from slipstream.run import training

    calls: list[str] = []

    def fake_warm_start(plan: object, model_dir: Path, on_check: object = None) -> dict:
        calls.append(str(model_dir))
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "model.bin").write_text("w")
        return {"steps": 3}

    monkeypatch.setattr(training, "warm_start", fake_warm_start)
    monkeypatch.setenv("SLIPSTREAM_WARMSTART_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(wc, "source_digest", lambda packages=wc.PACKAGES: "s")
    plan = demo_plan(env)
    _, first = training.initial_model(plan, tmp_path / "run1")
    model_dir, second = training.initial_model(plan, tmp_path / "run2")
    assert (model_dir / "model.bin").read_text() == "w"
    assert len(calls) == (1 if cached else 2)
    assert ("cached" in second) is cached and "cached" not in first
