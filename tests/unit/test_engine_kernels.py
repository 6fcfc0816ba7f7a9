"""bf16 matmuls upcast to fp32 (kernels.py) compute what torch's bf16 kernels compute.

The engine turns the upcast on by default on AVX2 CPUs, where torch's bf16 GEMM is ~30x
slower than fp32; these tests hold it to the native bf16 path's outputs: the same products up
to summation order, the same greedy tokens, the same seeded samples, log-probs within bf16
rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from engine_support import run_engine

from slipstream.engine import ByteTokenizer, GenerationRequest, SamplingParams, TorchEngine, build_tiny
from slipstream.engine.kernels import Fp32Weights, linear, project, upcast_bf16_default
from slipstream.engine.lora import attach_lora

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

SEED = 5
TOK = ByteTokenizer()
PROMPTS = ["1+1=", "a longer prompt with more bytes: ", "x", "twelve chars", "9*9="]


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of bf16's spacing at b's magnitude (8 mantissa bits)."""
    scale = b.float().abs().clamp(min=1e-3) * 2.0**-7
    return float(((a.float() - b.float()).abs() / scale).max())


def test_upcast_linear_matches_the_bf16_kernel_to_one_rounding() -> None:
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(16, 64, generator=gen).bfloat16()
    w = torch.randn(96, 64, generator=gen).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16()
    native = F.linear(x, w, b)
    up = linear(x, w, b, kernel=Fp32Weights())
    assert up.dtype == torch.bfloat16 and up.shape == native.shape
    # Both accumulate in fp32 and round once: at most one bf16 step apart.
    assert _bf16_ulps(up, native) <= 1.0 + 1e-6, f"seed {SEED}"
    assert torch.equal(linear(x, w, b, kernel=None), native)


def test_upcast_projection_through_a_lora_adapter() -> None:
    model, _ = build_tiny("tiny", seed=SEED)
    attach_lora(model, rank=4, alpha=8.0, seed=SEED)
    model = model.to(torch.bfloat16)
    proj = model.decoder_layers[0].self_attn.q_proj
    with torch.no_grad():
        proj.lora_B.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(SEED))
        x = torch.randn(3, 7, proj.in_features, generator=torch.Generator().manual_seed(SEED + 1)).bfloat16()
        native, up = project(proj, x, None), project(proj, x, Fp32Weights())
    assert up.dtype == torch.bfloat16
    assert (up.float() - native.float()).abs().max() <= 0.02 * native.float().abs().max(), f"seed {SEED}"


def test_fp32_copies_follow_in_place_weight_changes() -> None:
    weights = Fp32Weights()
    w = torch.randn(8, 4).bfloat16()
    first = weights(w)
    assert first.dtype == torch.float32 and torch.equal(first, w.float())
    assert weights(w) is first  # reused while the weight is unchanged
    with torch.no_grad():
        w.mul_(2)
    assert torch.equal(weights(w), w.float())  # the version counter moved: copied again
    assert weights.nbytes == 8 * 4 * 4
    weights.clear()
    assert weights.nbytes == 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_bf16_engine_upcast_equals_native_bf16(temperature: float) -> None:
    base, _ = build_tiny("tiny", seed=SEED)
    runs = []
    for upcast in (False, True):
        model = copy.deepcopy(base)
        engine = TorchEngine(
            model, TOK, max_batch=4, max_seq_len=96, device="cpu", dtype=torch.bfloat16, bf16_upcast=upcast
        )
        assert engine.bf16_upcast is upcast
        params = SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True, seed=SEED)
        reqs = [
            GenerationRequest(request_id=f"r{i}", prompt_ids=TOK.encode(p), params=params)
            for i, p in enumerate(PROMPTS)
        ]
        runs.append(run_engine(engine, reqs))
    native, up = runs
    for rid in native:
        (tok_up, lp_up), (tok_nat, lp_nat) = up[rid], native[rid]
        if temperature == 0.0:
            assert tok_up == tok_nat, f"{rid}: greedy tokens differ (seed {SEED})"
        # The tiny random model's distributions are nearly flat over 259 bytes, so a sampled
        # row may flip to a neighbouring token at a CDF boundary after a few steps: compare
        # over the shared prefix, which starts with the token sampled from the prefill.
        same = next((i for i, (a, b) in enumerate(zip(tok_up, tok_nat, strict=True)) if a != b), len(tok_nat))
        assert same >= 1, f"{rid}: first token differs (seed {SEED})"
        diff = max(abs(a - b) for a, b in zip(lp_up[:same], lp_nat[:same], strict=True))
        assert diff < 0.05, f"{rid}: log-probs differ by {diff} (seed {SEED})"


def test_upcast_is_off_for_fp32_and_decided_by_device() -> None:
    base, _ = build_tiny("tiny", seed=SEED)
    engine = TorchEngine(base, TOK, max_batch=1, max_seq_len=32, device="cpu", bf16_upcast=True)
    assert engine.bf16_upcast is False  # fp32 has nothing to upcast
    assert upcast_bf16_default(torch.device("meta")) is False
    expected = torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT")
    assert upcast_bf16_default(torch.device("cpu")) is expected


def test_new_weights_reach_the_upcast_copies() -> None:
    """After apply_weights a bf16 upcast engine computes with the new weights, not stale fp32 copies."""
    old, _ = build_tiny("tiny", seed=SEED)
    new, _ = build_tiny("tiny", seed=SEED + 1)
    new = new.to(torch.bfloat16)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def greedy(engine: TorchEngine, rid: str) -> list[int]:
        request = GenerationRequest(request_id=rid, prompt_ids=TOK.encode("9*9="), params=params)
        return run_engine(engine, [request])[rid][0]

    kw = {"max_batch": 1, "max_seq_len": 32, "device": "cpu", "dtype": torch.bfloat16, "bf16_upcast": True}
    engine = TorchEngine(old, TOK, **kw)  # type: ignore[arg-type]
    before = greedy(engine, "a")
    engine.apply_weights(1, {k: v.clone() for k, v in new.state_dict().items()})
    after = greedy(engine, "b")
    fresh = greedy(TorchEngine(copy.deepcopy(new), TOK, **kw), "c")  # type: ignore[arg-type]
    assert after == fresh and after != before, f"seed {SEED}"
