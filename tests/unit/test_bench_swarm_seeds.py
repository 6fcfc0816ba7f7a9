"""`slipstream bench swarm-seeds`: the swarm demo's runs over seeds and arms, with their seed spread.

The reports here are written the way `swarm_demo.run` writes swarm.json (its keys: `arms`, `seed`,
`before/<arm>/<split>`, `after/...`, `curve`, `budget_curves`), with chosen numbers, so every
figure the bench prints can be worked out by hand.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from slipstream.bench import swarm_seeds
from slipstream.bench.main import main

pytestmark = pytest.mark.unit


def _report(
    seed: int, arm: str, par: tuple[float, float], acc: tuple[float, float], turns: list[float]
) -> dict[str, Any]:
    r: dict[str, Any] = {"seed": seed, "steps": len(turns), "arms": [arm]}
    for stage, i in (("before", 0), ("after", 1)):
        r[f"{stage}/{arm}/heldout"] = {
            "parallel_rate": par[i],
            "accuracy": acc[i],
            "perf": 0.2 + acc[i],
            "latency_s": 2.0,
        }
        r[f"{stage}/{arm}/train"] = {"parallel_rate": par[i], "accuracy": acc[i]}
    if arm.startswith("swarm"):
        r[f"ceiling/{arm}/heldout"] = {"accuracy": 0.5 + seed / 10, "perf": 0.8}
        r["curve"] = [{"step": s + 1, "parallel_turns": t} for s, t in enumerate(turns)]
    r["budget_curves"] = {
        arm: {"curves": {"4": [{"budget": 3, "accuracy": acc[1] / 2}, {"budget": 4, "accuracy": acc[1]}]}}
    }
    return r


def _write(tmp_path: Path, name: str, report: dict[str, Any]) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "swarm.json").write_text(json.dumps(report))
    return d


def test_changes_their_seed_spread_and_the_paired_arms(tmp_path: Path) -> None:
    runs = [
        _write(tmp_path, "s0", _report(0, "swarm", (0.0, 0.1), (0.0, 0.1), [0.0, 0.0, 0.2, 0.4])),
        _write(tmp_path, "s1", _report(1, "swarm", (0.0, 0.2), (0.0, 0.0), [0.1, 0.1, 0.3, 0.3])),
        _write(tmp_path, "s2", _report(2, "swarm", (0.1, 0.4), (0.1, 0.2), [0.0, 0.0, 0.0, 0.6])),
        _write(tmp_path, "l0", _report(0, "swarm-lambda0", (0.0, 0.0), (0.0, 0.0), [0.0, 0.1, 0.0, 0.1])),
        _write(tmp_path, "l1", _report(1, "swarm-lambda0", (0.0, 0.1), (0.0, 0.0), [0.1, 0.0, 0.1, 0.0])),
        _write(tmp_path, "single0", _report(0, "single", (0.0, 0.0), (0.3, 0.4), [])),
    ]
    result = swarm_seeds.aggregate([swarm_seeds.load(p) for p in runs], window=2)
    par = result["arms"]["swarm"]["changes"]["heldout/parallel_rate"]
    assert par["deltas"] == pytest.approx([0.1, 0.2, 0.3])
    assert par["mean"] == pytest.approx(0.2) and par["sd"] == pytest.approx(0.1)
    assert par["se"] == pytest.approx(0.1 / math.sqrt(3), abs=1e-4)
    assert par["mean_in_se"] == pytest.approx(0.2 / (0.1 / math.sqrt(3)), abs=0.01) and par["rose_every_seed"]
    # the batches: mean of the first 2 steps -> mean of the last 2
    batches = result["arms"]["swarm"]["changes"]["batches/parallel_turns"]
    assert batches["per_seed"] == {"0": [0.0, 0.3], "1": [0.1, 0.3], "2": [0.0, 0.3]}
    # accuracy did not rise on seed 1: not every seed
    assert not result["arms"]["swarm"]["changes"]["heldout/accuracy"]["rose_every_seed"]
    # λ annealed minus λ = 0, on seeds 0 and 1 only (seed 2 has no ablation): the λ = 0 batches stay
    # at 0.05 -> 0.05, so the differences are the annealed rises 0.3 and 0.2; held-out 0.1 - 0, 0.2 - 0.1
    lam = result["paired"]["swarm - swarm-lambda0 (change during RL)"]
    assert lam["seeds"] == [0, 1]
    assert lam["batches/parallel_turns"]["deltas"] == pytest.approx([0.3, 0.2])
    assert lam["heldout/parallel_rate"]["deltas"] == pytest.approx([0.1, 0.1])
    # swarm minus single after RL on seed 0: accuracy 0.1 - 0.4
    single = result["paired"]["swarm - single (after RL)"]
    assert single["seeds"] == [0] and single["heldout/accuracy"]["deltas"] == pytest.approx([-0.3])
    assert single["heldout/accuracy"]["sd"] is None  # one seed: no spread, and the table says so
    # the single arm has no batches' curve (it has no parallel turns to count)
    assert "batches/parallel_turns" not in result["arms"]["single"]["changes"]
    # the ceiling: the teacher's parallel orchestrator over each run's sub-agents, per seed and mean
    top = result["arms"]["swarm"]["ceiling_heldout"]
    assert top["per_seed"]["2"]["accuracy"] == pytest.approx(0.7) and top["accuracy_mean"] == pytest.approx(0.6)
    assert result["arms"]["single"]["ceiling_heldout"]["accuracy_mean"] is None
    # budget curves: the mean over seeds per N and B
    point = result["arms"]["swarm"]["budget_mean"]["4"]["4"]
    assert point["mean"] == pytest.approx((0.1 + 0.0 + 0.2) / 3)
    # and their spread over the seeds: sd, the range the plot draws as a band
    assert point["sd"] == pytest.approx(0.1) and (point["min"], point["max"]) == (0.0, 0.2)
    assert result["arms"]["single"]["budget_mean"]["4"]["4"]["sd"] is None  # one seed: no spread


def test_the_command_prints_writes_json_and_a_png_and_names_a_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = _write(tmp_path, "a", _report(0, "swarm", (0.0, 0.1), (0.0, 0.1), [0.0, 0.2]))
    b = _write(tmp_path, "b", _report(1, "swarm", (0.0, 0.3), (0.0, 0.0), [0.0, 0.4]))
    out = tmp_path / "out"
    assert main(["swarm-seeds", str(a), str(b / "swarm.json"), "--out", str(out), "--window", "1"]) == 0
    text = capsys.readouterr().out
    assert "swarm: before -> after RL" in text and "0.000 -> 0.300" in text
    assert "held-out accuracy: seed 0 0.500, seed 1 0.600" in text
    # the budget curves' table: at B = 4 accuracy 0.1 and 0.0 after RL, mean 0.05, sd 0.071, 2 seeds
    assert "vs critical-step budget" in text and "0.050 (0.071; 2)" in text
    written = json.loads((out / "swarm-seeds.json").read_text())
    assert written["arms"]["swarm"]["changes"]["heldout/parallel_rate"]["mean"] == pytest.approx(0.2)
    assert (out / "swarm-seeds.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the same seed twice for one arm is refused by name, as is a directory without a report
    assert main(["swarm-seeds", str(a), str(a)]) == 2
    assert "seed 0 twice" in capsys.readouterr().out
    assert main(["swarm-seeds", str(tmp_path)]) == 2
    assert "no swarm.json" in capsys.readouterr().out


def test_equal_changes_have_no_spread_and_no_mean_in_standard_errors() -> None:
    from slipstream.bench.swarm_seeds import _fmt, spread

    # -5/48 on two seeds: float noise of ~1e-17 once printed as "-2083.0 se"
    same = spread([0.125 - 0.22916666666666666, 0.0208333333333333 - 0.125])
    assert same["sd"] == 0.0 and same["mean_in_se"] is None
    assert "no spread" in _fmt(same) and " se;" not in _fmt(same)
    assert spread([0.1, 0.3])["mean_in_se"] == 2.0


def test_the_sign_flip_p_counts_the_sign_assignments_by_hand() -> None:
    from slipstream.bench.swarm_seeds import sign_flip_p, spread

    # three seeds that all rose: only the measured signs reach the sum, 1 of 8 assignments
    assert sign_flip_p([0.1, 0.2, 0.3]) == pytest.approx(1 / 8)
    # sum 0.3; at or above it: as measured (0.3), the third flipped (0.5), the first and third flipped (0.3)
    assert sign_flip_p([0.1, 0.3, -0.1]) == pytest.approx(3 / 8)
    # no change at all: every assignment ties the measured 0
    assert sign_flip_p([0.0, 0.0]) == pytest.approx(1.0)
    # a mean below 0 is no evidence of a rise
    assert sign_flip_p([-0.2, -0.1, 0.05]) > 0.5
    assert sign_flip_p([]) is None and sign_flip_p([0.1] * 21) is None
    # six seeds, one of them flat: the smallest p six seeds allow counts the flat seed's two signs
    assert spread([0.4, 0.0, 0.5, 0.3, 0.2, 0.25])["p_sign_flip"] == pytest.approx(2 / 64, abs=1e-4)
