"""`slipstream bench engine` on SmolLM2, shrunk: both workload kinds run end to end and report
what they did (the chat workload's rows stop at eos and share their prompts' common opening)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from slipstream.cli import bench_engine

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]


def test_chat_and_distinct_rows_report_tokens_prefill_and_verdicts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    parser = argparse.ArgumentParser()
    bench_engine.register(parser.add_subparsers())
    out = tmp_path / "engine.json"
    argv = "engine --batches 16 --dtypes float32 --workloads chat distinct --new 4 --prompt-len 16"
    argv += " --repeats 1 --threads 1 --no-learner"
    args = parser.parse_args([*argv.split(), "--json", str(out)])
    threads = torch.get_num_threads()
    try:
        assert args.func(args) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    rows = {r["workload"]: r for r in result["generation"]}
    assert set(rows) == {"chat", "distinct"}
    chat, distinct = rows["chat"], rows["distinct"]
    (pair,) = chat["repeats"]
    # Sampled to eos: at most --new tokens a row, on both sides.
    assert 16 <= pair["engine_tokens"] <= 16 * 4 and 16 <= pair["hf_tokens"] <= 16 * 4
    # The 16 demo prompts share their system prompt and one-shot turns: 15 rows copy that opening.
    assert chat["engine_prompt_shared_tokens"] >= 15 * 40
    assert chat["engine_prefill_tokens"] + chat["engine_prompt_shared_tokens"] > 16 * 80
    assert distinct["repeats"][0]["engine_tokens"] == 16 * 4  # eos ignored
    verdicts = result["target"]["engine_met_by_workload"]
    assert set(verdicts) == {"chat", "distinct"}
    assert "engine target >= 1.5x at batch >= 16: chat " in capsys.readouterr().out
