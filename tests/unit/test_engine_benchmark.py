"""The engine benchmark command runs end to end and reports consistent figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slipstream.engine import Engine, TorchEngine, build_tiny
from slipstream.engine.benchmark import main

pytestmark = pytest.mark.unit


def test_benchmark_writes_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = torch.get_num_threads()
    try:
        rows = main(
            [
                "--max-batch",
                "2",
                "--max-tokens",
                "6",
                "--prompt-len",
                "4",
                "--threads",
                "1",
                "--json",
                str(tmp_path / "b.json"),
            ]
        )
    finally:
        torch.set_num_threads(before)
    assert json.loads((tmp_path / "b.json").read_text()) == rows
    (row,) = rows
    assert row["tokens"] == 2 * 2 * 6  # 2 x max_batch requests, eos ignored
    assert row["tokens_per_s"] > 0 and row["params"] == 1_050_496
    assert "max_batch=2" in capsys.readouterr().out


def test_torch_engine_satisfies_the_protocol() -> None:
    model, tok = build_tiny("tiny", seed=0)
    assert isinstance(TorchEngine(model, tok, device="cpu", max_batch=1, max_seq_len=8), Engine)
