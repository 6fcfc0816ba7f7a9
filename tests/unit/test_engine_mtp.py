"""MTP modules (engine/mtp.py) and their self-distillation (engine/mtp_distill.py): the loss lines
depth k at position t up with the main head at t+k, distillation lowers the held-out KL without
touching the main model, and the modules are saved, loaded and shipped with the model's weights."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from slipstream.engine import ByteTokenizer, TorchEngine, build_tiny, load_pretrained, save_pretrained
from slipstream.engine.config import ModelConfig
from slipstream.engine.mtp import modules_of
from slipstream.engine.mtp_distill import attach_mtp, distill_loss, generate_corpus, held_out_kl, self_distill

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

TOK = ByteTokenizer()


def test_distill_loss_matches_a_position_by_position_computation() -> None:
    model, _ = build_tiny("micro", seed=1)
    attach_mtp(model, 2, seed=2)
    ids = torch.tensor([TOK.encode("12+30=42 and 7+8=15")])
    mask = torch.ones_like(ids)
    mask_short = mask.clone()
    mask_short[0, -3:] = 0  # right padding: positions whose inputs or targets are padding drop out
    with torch.no_grad():
        loss, per_depth = distill_loss(model, ids, mask_short)
        hidden = model.hidden_states(ids)
        teacher = torch.log_softmax(model.lm_head(hidden), dim=-1)[0]
        embeds = model.model.embed_tokens(ids)[0]
        modules = modules_of(model.mtp)
        n = int(mask_short.sum())
        expected = []
        for k in (1, 2):
            kls = []
            for t in range(n - k):
                x = hidden[0, t]
                for j in range(1, k + 1):
                    x = modules[j - 1](x, embeds[t + j])
                q = torch.log_softmax(model.lm_head(modules[k - 1].head_input(x)), dim=-1)
                p = teacher[t + k]
                kls.append(float((p.exp() * (p - q)).sum()))
            expected.append(sum(kls) / len(kls))
    assert per_depth == pytest.approx(expected, rel=1e-4)
    assert float(loss) == pytest.approx(sum(expected), rel=1e-4)


def test_self_distillation_lowers_held_out_kl_and_leaves_the_main_model_alone() -> None:
    model, tok = build_tiny("micro", seed=3)
    attach_mtp(model, 2, seed=4)
    main_before = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    prompts = [tok.encode(f"{a}+{b}=") for a, b in zip(range(10, 26), range(40, 56), strict=True)]
    corpus = generate_corpus(model, tok, prompts[:12], samples_per_prompt=3, max_tokens=32, seed=5)
    held = generate_corpus(model, tok, prompts[12:], samples_per_prompt=2, max_tokens=32, seed=6)
    before = held_out_kl(model, held)
    losses = self_distill(model, corpus, steps=40, lr=1e-2, batch_size=8)
    after = held_out_kl(model, held)
    assert len(before) == len(after) == 2
    for k in range(2):
        assert after[k] < 0.5 * before[k], (before, after)
    assert losses[-1] < losses[0]
    for name, value in model.state_dict().items():
        if not name.startswith("mtp."):
            assert torch.equal(value, main_before[name]), name


def test_mtp_modules_are_saved_loaded_and_applied_with_the_weights(tmp_path: Path) -> None:
    model, tok = build_tiny("micro", seed=7)
    attach_mtp(model, 2, seed=8)
    assert model.config.mtp_depth == 2
    assert ModelConfig.from_hf(model.config.to_hf()).mtp_depth == 2
    save_pretrained(model, tok, tmp_path / "m")
    loaded, _ = load_pretrained(tmp_path / "m")
    assert loaded.config.mtp_depth == 2
    state = model.state_dict()
    assert any(k.startswith("mtp.1.") for k in state)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, state[name]), name
    # A weight version must carry the MTP modules too (the draft follows the main model's version).
    engine = TorchEngine(copy.deepcopy(model), tok, max_batch=1, max_seq_len=32, device="cpu", speculative_tokens=2)
    without_mtp = {k: v for k, v in state.items() if not k.startswith("mtp.")}
    with pytest.raises(ValueError, match=r"tensors missing \(first: 'mtp\.0\."):
        engine.apply_weights(1, without_mtp)
    engine.apply_weights(1, {k: v.clone() for k, v in state.items()})


def test_speculation_needs_enough_mtp_modules() -> None:
    model, tok = build_tiny("micro", seed=0)
    with pytest.raises(ValueError, match="mtp_depth >= 1; this one has mtp_depth 0"):
        TorchEngine(model, tok, max_batch=1, device="cpu", speculative_tokens=1)
    attach_mtp(model, 2)
    with pytest.raises(ValueError, match="mtp_depth >= 3; this one has mtp_depth 2"):
        TorchEngine(model, tok, max_batch=1, device="cpu", speculative_tokens=3)
    with pytest.raises(ValueError, match="mtp_depth must be >= 0"):
        ModelConfig(
            model_type="llama",
            hidden_size=8,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=8,
            mtp_depth=-1,
        )
