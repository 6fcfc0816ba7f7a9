"""MKL's packed GEMM (kernels.py `MklPackedWeights`) computes what `F.linear` computes.

The engine turns it on by default for fp32 on CPU; these tests hold it to torch's own kernel:
products equal to fp32 rounding at every row count from one packed copy (the packed layout must
not depend on the row count it was packed for), the same greedy tokens with and without it
(LoRA adapters included), and new weights reaching the packed copies.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from engine_support import run_engine

from slipstream.engine import ByteTokenizer, GenerationRequest, SamplingParams, TorchEngine, build_tiny
from slipstream.engine.kernels import PACKED_MAX_ROWS, MklPackedWeights, linear, mkl_pack_available, project
from slipstream.engine.lora import attach_lora

pytestmark = [
    pytest.mark.unit,
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch built without MKL"),
]

SEED = 11
TOK = ByteTokenizer()
PROMPTS = ["1+1=", "a longer prompt with more bytes: ", "x", "twelve chars", "9*9="]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to fp32 summation order (K <= 1536 products of unit-scale values)."""
    return bool(torch.allclose(a, b, rtol=1e-5, atol=1e-4))


@pytest.mark.parametrize("first_rows", [1, 16, 64])
def test_one_packed_copy_serves_every_row_count(first_rows: int) -> None:
    gen = torch.Generator().manual_seed(SEED)
    w = torch.randn(1536, 576, generator=gen)
    b = torch.randn(1536, generator=gen)
    packed = MklPackedWeights()
    # The first call packs for its row count; every later row count uses that same copy.
    for rows in (first_rows, 1, 3, 16, 17, 64, PACKED_MAX_ROWS):
        x = torch.randn(rows, 576, generator=gen)
        got = linear(x, w, b, packed)
        assert got.shape == (rows, 1536)
        assert _close(got, F.linear(x, w, b)), f"rows {rows} after packing for {first_rows} (seed {SEED})"
    assert len(packed) == 1


def test_packed_linear_keeps_leading_dims_and_leaves_large_calls_to_torch() -> None:
    gen = torch.Generator().manual_seed(SEED)
    w = torch.randn(96, 64, generator=gen)
    packed = MklPackedWeights()
    x = torch.randn(4, 3, 64, generator=gen)
    got = linear(x, w, None, packed)
    assert got.shape == (4, 3, 96) and _close(got, F.linear(x, w)), f"seed {SEED}"
    big = torch.randn(PACKED_MAX_ROWS + 1, 64, generator=gen)
    assert torch.equal(linear(big, w, None, packed), F.linear(big, w))  # a prefill chunk: torch's kernel


def test_packed_copies_follow_in_place_weight_changes() -> None:
    gen = torch.Generator().manual_seed(SEED)
    w = torch.randn(32, 16, generator=gen)
    x = torch.randn(4, 16, generator=gen)
    packed = MklPackedWeights()
    first = packed.copy_of(w, 4)
    assert packed.copy_of(w, 4) is first  # reused while the weight is unchanged
    with torch.no_grad():
        w.mul_(-2)
    assert _close(linear(x, w, None, packed), F.linear(x, w))  # the version counter moved: repacked
    packed.clear()
    assert len(packed) == 0


def test_packed_projection_through_a_lora_adapter() -> None:
    model, _ = build_tiny("tiny", seed=SEED)
    attach_lora(model, rank=4, alpha=8.0, seed=SEED)
    proj = model.decoder_layers[0].mlp.down_proj
    with torch.no_grad():
        proj.lora_B.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(SEED))
        x = torch.randn(3, 1, proj.in_features, generator=torch.Generator().manual_seed(SEED + 1))
        native, packed = project(proj, x, None), project(proj, x, MklPackedWeights())
    assert _close(packed, native), f"seed {SEED}"
    assert not torch.equal(proj.lora_B, torch.zeros_like(proj.lora_B))  # the adapter contributes


def _greedy_requests() -> list[GenerationRequest]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return [
        GenerationRequest(request_id=f"r{i}", prompt_ids=TOK.encode(p), params=params) for i, p in enumerate(PROMPTS)
    ]


@pytest.mark.parametrize("lora", [False, True])
def test_fp32_engine_greedy_tokens_equal_with_and_without_packing(lora: bool) -> None:
    base, _ = build_tiny("tiny", seed=SEED)
    if lora:
        attach_lora(base, rank=4, alpha=8.0, seed=SEED)
        with torch.no_grad():
            for name, p in base.named_parameters():
                if name.endswith("lora_B"):
                    p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(SEED))
    runs = []
    for pack in (False, True):
        engine = TorchEngine(copy.deepcopy(base), TOK, max_batch=4, max_seq_len=96, device="cpu", mkl_pack=pack)
        assert engine.mkl_pack is pack
        runs.append(run_engine(engine, _greedy_requests()))
        if pack:
            assert engine._kernel is not None and len(engine._kernel) > 0  # the packed path ran
    plain, packed = runs
    for rid in plain:
        assert packed[rid][0] == plain[rid][0], f"{rid}: greedy tokens differ (lora={lora}, seed {SEED})"
        diff = max(abs(a - b) for a, b in zip(packed[rid][1], plain[rid][1], strict=True))
        assert diff < 1e-3, f"{rid}: log-probs differ by {diff} (seed {SEED})"


def test_packing_is_fp32_cpu_only_and_can_be_turned_off() -> None:
    assert mkl_pack_available(torch.device("cpu"), torch.float32) is True
    assert mkl_pack_available(torch.device("cpu"), torch.bfloat16) is False
    assert mkl_pack_available(torch.device("meta"), torch.float32) is False
    base, _ = build_tiny("tiny", seed=SEED)
    assert TorchEngine(copy.deepcopy(base), TOK, max_batch=1, max_seq_len=32, device="cpu").mkl_pack is True
    off = TorchEngine(copy.deepcopy(base), TOK, max_batch=1, max_seq_len=32, device="cpu", mkl_pack=False)
    assert off.mkl_pack is False and off._kernel is None
    bf16 = TorchEngine(base, TOK, max_batch=1, max_seq_len=32, device="cpu", dtype=torch.bfloat16, mkl_pack=True)
    assert bf16.mkl_pack is False  # packed GEMM is fp32 only


def test_new_weights_reach_the_packed_copies() -> None:
    """After apply_weights a packed engine computes with the new weights, not stale packed copies."""
    old, _ = build_tiny("tiny", seed=SEED)
    new, _ = build_tiny("tiny", seed=SEED + 1)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def greedy(engine: TorchEngine, rid: str) -> list[int]:
        request = GenerationRequest(request_id=rid, prompt_ids=TOK.encode("9*9="), params=params)
        return run_engine(engine, [request])[rid][0]

    engine = TorchEngine(old, TOK, max_batch=1, max_seq_len=32, device="cpu", mkl_pack=True)
    before = greedy(engine, "a")
    engine.apply_weights(1, {k: v.clone() for k, v in new.state_dict().items()})
    after = greedy(engine, "b")
    fresh = greedy(TorchEngine(copy.deepcopy(new), TOK, max_batch=1, max_seq_len=32, device="cpu", mkl_pack=False), "c")
    assert after == fresh and after != before, f"seed {SEED}"
