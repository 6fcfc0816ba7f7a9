"""`slipstream bench engine` on SmolLM2, shrunk: both workload kinds run end to end and report
what they did (the chat workload's rows stop at eos and share their prompts' common opening);
its speculation section, on the tiny preset, reports acceptance and tokens/s both ways."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from slipstream.bench import engine as bench_engine

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]


def test_chat_and_distinct_rows_report_tokens_prefill_and_verdicts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    parser = argparse.ArgumentParser()
    bench_engine.register(parser.add_subparsers())
    out = tmp_path / "engine.json"
    argv = "engine --batches 16 --dtypes float32 --workloads chat distinct --new 4 --prompt-len 16"
    argv += " --repeats 1 --threads 1 --no-learner --no-speculative"
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
    # vLLM is opt-in (--vllm): not asked for, the JSON says so and no row has a vLLM column.
    assert result["vllm"]["ran"] is False and result["vllm"]["skipped_because"].startswith("not asked for")
    assert all("vllm_tok_s" not in r and "vllm_tok_s" not in r["repeats"][0] for r in result["generation"])
    (startup,) = result["startup"]
    assert startup["dtype"] == "float32" and startup["engine_load_s"] > 0 and startup["hf_load_s"] > 0
    assert startup["bench_process_peak_rss_mb"] > 500  # SmolLM2 in fp32 twice, ~540 MB each


def test_speculation_section_reports_acceptance_and_both_speeds(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    parser = argparse.ArgumentParser()
    bench_engine.register(parser.add_subparsers())
    out = tmp_path / "engine.json"
    argv = "engine --model tiny --no-generation --no-learner --new 12 --repeats 1 --threads 1"
    argv += (
        " --spec-tokens 2 --spec-batches 1 4 --spec-distill-steps 30 --spec-corpus-prompts 8 --spec-corpus-tokens 32"
    )
    args = parser.parse_args([*argv.split(), "--json", str(out)])
    threads = torch.get_num_threads()
    try:
        assert args.func(args) == 0
    finally:
        torch.set_num_threads(threads)
    spec = json.loads(out.read_text())["speculation"]
    assert spec["k"] == 2 and spec["model"] == "tiny" and spec["distill"]["mtp_fresh"]
    distill = spec["distill"]
    assert distill["corpus_sequences"] == 8 * 4
    assert all(a < b for a, b in zip(distill["held_out_kl_after"], distill["held_out_kl_before"], strict=True))
    assert [(r["batch"], r["temperature"]) for r in spec["rows"]] == [(1, 0.0), (1, 0.7), (4, 0.0), (4, 0.7)]
    for row in spec["rows"]:
        (pair,) = row["repeats"]
        assert pair["plain"]["tokens"] == pair["speculative"]["tokens"] == row["batch"] * 12
        assert pair["speculative"]["drafted"] > 0 and 0.0 <= row["acceptance_rate"] <= 1.0
        assert pair["speculative"]["steps"] < pair["plain"]["steps"] or row["acceptance_rate"] == 0.0
        assert row["plain_tok_s"] > 0 and row["speculative_tok_s"] > 0
