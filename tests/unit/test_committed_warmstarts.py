"""The warm-starts committed under examples/runs (made by `python -m slipstream.run.warmstart_many`,
so a later session or a newcomer can start RL from them with `--init-model`) load as models and
say what made them."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.engine.loading import load_pretrained
from slipstream.run.warmstart import given_figures

RUNS = Path(__file__).resolve().parents[2] / "examples" / "runs"
MODELS = sorted(RUNS.glob("*/*/model"))


def test_there_are_committed_warmstarts() -> None:
    assert MODELS, f"no warm-start under {RUNS}"


@pytest.mark.parametrize("model", MODELS, ids=[str(m.parent.relative_to(RUNS)) for m in MODELS])
def test_committed_warmstart_loads_and_names_its_making(model: Path) -> None:
    name, seed = model.parent.name.rsplit("-s", 1)  # <env>-s<seed>, or the swarm's <arm>-s<seed>
    made = given_figures(model)
    assert made["env"] == model.parents[1].name and made["seed"] == int(seed)
    assert made.get("arm", made["env"]) == name
    assert made["steps"] > 0 and 0 <= made["probe_accuracy"] <= 1 and made["sources"] and made["torch"]
    net, tokenizer = load_pretrained(model)
    assert sum(p.numel() for p in net.parameters()) > 100_000 and tokenizer is not None
