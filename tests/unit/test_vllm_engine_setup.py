"""`VllmEngine` before any server runs: the missing-venv error, the command and environment it would
start vLLM with, the checkpoint's parameter description, and which `[model]`s it refuses.

The engine against a real vLLM server is tests/vllm_tier (`make test-vllm`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slipstream.engine import build_tiny, save_pretrained
from slipstream.engine.backend import EngineBackend
from slipstream.engine.source import ModelSource
from slipstream.engine.vllm_engine import CLIENT_KEEPALIVE_S, EXTENSION_DIR, VllmEngine, VllmEngineError
from slipstream.engine.vllm_setup import checkpoint_specs, model_dir_for

pytestmark = pytest.mark.unit


async def test_a_missing_vllm_venv_is_named_with_how_to_build_it(tmp_path: Path) -> None:
    engine = VllmEngine(tmp_path, python=tmp_path / "nowhere" / "python")
    with pytest.raises(VllmEngineError, match=r"nowhere/python does not exist.*make vllm-venv"):
        await engine.start()
    assert engine.proc is None


def test_the_command_loads_the_extension_and_reports_processed_logprobs(tmp_path: Path) -> None:
    cfg = EngineBackend(type="vllm", vllm_max_model_len=512, vllm_args=["--seed", "1"], vllm_kv_cache_gb=2)
    engine = VllmEngine.from_config(cfg, tmp_path, dtype="bfloat16")
    cmd = engine.command(4321)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(cmd)
    for part in (
        f"--model {tmp_path}",
        "--port 4321",
        "--host 127.0.0.1",
        "--dtype bfloat16",
        "--worker-extension-cls slipstream_vllm_ext.WeightLoader",
        "--logprobs-mode processed_logprobs",
        "--max-model-len 512",
        "--enforce-eager",
    ):
        assert part in joined, part
    assert cmd[-2:] == ["--seed", "1"]
    env = engine.environment()
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["PYTHONPATH"] == str(EXTENSION_DIR)
    # The server keeps idle connections longer than the client reuses them: no request on a closed one.
    assert int(env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]) > CLIENT_KEEPALIVE_S
    assert env["VLLM_CPU_OMP_THREADS_BIND"].startswith("0-")  # threads = 0: one bound to every core
    assert (EXTENSION_DIR / "slipstream_vllm_ext.py").is_file()
    one = VllmEngine(tmp_path, threads=1).environment()
    assert (one["VLLM_CPU_OMP_THREADS_BIND"], one["OMP_NUM_THREADS"]) == ("nobind", "1")


def test_checkpoint_specs_describe_the_saved_tensors(tmp_path: Path) -> None:
    model, tok = build_tiny("tiny", seed=1)
    save_pretrained(model, tok, tmp_path)
    specs, aliases = checkpoint_specs(tmp_path)
    assert specs == {n: (tuple(p.shape), "float32") for n, p in model.named_parameters()}
    assert aliases == ({"lm_head.weight": "model.embed_tokens.weight"} if model.config.tie_word_embeddings else {})
    half, _ = build_tiny("micro", seed=1, dtype=torch.bfloat16)
    save_pretrained(half, tok, tmp_path / "half")
    assert {s.dtype for s in checkpoint_specs(tmp_path / "half")[0].values()} == {"bfloat16"}


def test_a_preset_is_written_once_as_a_checkpoint_and_lora_or_moe_are_refused(tmp_path: Path) -> None:
    source = ModelSource(preset="micro", seed=3, cache_dir=str(tmp_path))
    directory = model_dir_for(source)
    assert (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file()
    assert model_dir_for(source) == directory and len(list(tmp_path.iterdir())) == 1
    with pytest.raises(ValueError, match="LoRA"):
        model_dir_for(ModelSource(preset="micro", lora_rank=2, cache_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="MoE"):
        model_dir_for(ModelSource(preset="tiny-moe", cache_dir=str(tmp_path)))
