"""The plain-torch decoder: presets, cached forward vs full forward, padding, save/load, config checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slipstream.engine import ByteTokenizer, ModelConfig, build_tiny, count_parameters, load_pretrained, save_pretrained
from slipstream.engine.loading import model_from_state_dict

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

SEED = 7


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    model, _ = build_tiny("tiny", seed=SEED)
    return model.eval()


def test_presets_have_the_documented_sizes() -> None:
    model, tok = build_tiny("tiny", seed=0)
    assert count_parameters(model) == 1_050_496
    assert model.config.vocab_size == tok.vocab_size == 259
    cfg = ModelConfig.from_hf(model.config.to_hf())
    assert cfg == model.config


def test_25m_preset_parameter_count() -> None:
    with torch.device("meta"):
        from slipstream.engine import PRESETS, CausalLM

        model = CausalLM(PRESETS["25m"])
    assert 24_000_000 < count_parameters(model) < 26_000_000


def test_build_tiny_is_seeded_and_leaves_global_rng_alone(tiny: torch.nn.Module) -> None:
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    again, _ = build_tiny("tiny", seed=SEED)
    after = torch.rand(1)
    assert torch.equal(before, after)
    for (n1, a), (n2, b) in zip(tiny.state_dict().items(), again.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(a, b), n1
    other, _ = build_tiny("tiny", seed=SEED + 1)
    assert not torch.equal(other.lm_head.weight, again.lm_head.weight)


def test_hf_parameter_names(tiny: torch.nn.Module) -> None:
    names = set(tiny.state_dict())
    assert "model.embed_tokens.weight" in names
    assert "model.layers.3.self_attn.q_proj.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names
    assert "model.layers.0.post_attention_layernorm.weight" in names
    assert "model.norm.weight" in names and "lm_head.weight" in names
    assert len(names) == 2 + 1 + 4 * 9  # embed, lm_head, norm + 9 tensors per layer


def test_cached_forward_matches_full_forward_across_slots_and_lengths(tiny: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, 259, (3, 24), generator=gen)
    lengths = [24, 9, 15]
    with torch.no_grad():
        full = tiny(ids)
        cache = tiny.new_cache(slots=5, max_seq_len=32)
        slots = [4, 1, 2]  # deliberately not consecutive
        # prefill each row up to length-1, then decode the last token of all three in one batch
        for row, (n, slot) in enumerate(zip(lengths, slots, strict=True)):
            out = tiny.forward_cached(ids[row : row + 1, : n - 1], torch.arange(n - 1)[None], cache, [slot])
            assert (out[0] - full[row, : n - 1]).abs().max() < 1e-5
        last = torch.stack([ids[r, n - 1 : n] for r, n in enumerate(lengths)])
        pos = torch.tensor([[n - 1] for n in lengths])
        step = tiny.forward_cached(last, pos, cache, slots)
    for row, n in enumerate(lengths):
        assert (step[row, 0] - full[row, n - 1]).abs().max() < 1e-5, f"row {row}"


def test_bf16_decode_attention_matches_the_sdpa_kernel(tiny: torch.nn.Module) -> None:
    """bf16 decode on CPU takes the grouped-matmul attention path; prefill keeps torch's kernel."""
    import copy

    model = copy.deepcopy(tiny).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, 259, (3, 20), generator=gen)
    lengths = [20, 7, 13]
    slots = [2, 0, 1]
    with torch.no_grad():
        cache = model.new_cache(slots=3, max_seq_len=24)
        ref = model.new_cache(slots=3, max_seq_len=24)
        for row, (n, slot) in enumerate(zip(lengths, slots, strict=True)):
            model.forward_cached(ids[row : row + 1, : n - 1], torch.arange(n - 1)[None], cache, [slot])
            model.forward_cached(ids[row : row + 1, : n - 1], torch.arange(n - 1)[None], ref, [slot])
        last = torch.stack([ids[r, n - 1 : n] for r, n in enumerate(lengths)])
        pos = torch.tensor([[n - 1] for n in lengths])
        step = model.forward_cached(last, pos, cache, slots)[:, 0].float()
        # The same step through torch's kernel: a 2-token forward whose first token rewrites n-2.
        two = torch.stack([ids[r, n - 2 : n] for r, n in enumerate(lengths)])
        kernel = model.forward_cached(two, torch.cat([pos - 1, pos], dim=1), ref, slots)[:, 1].float()
    assert (step - kernel).abs().max() < 0.05 * kernel.abs().max()
    assert (step.argmax(-1) == kernel.argmax(-1)).all()


def test_attention_mask_left_and_right_padding(tiny: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, 256, (1, 12), generator=gen)
    with torch.no_grad():
        plain = tiny(ids)[0]
        right = torch.cat([ids, torch.full((1, 4), 256)], dim=1)
        rmask = torch.cat([torch.ones(1, 12), torch.zeros(1, 4)], dim=1).long()
        left = torch.cat([torch.full((1, 4), 256), ids], dim=1)
        lmask = torch.cat([torch.zeros(1, 4), torch.ones(1, 12)], dim=1).long()
        got_right = tiny(right, attention_mask=rmask)[0, :12]
        got_left = tiny(left, attention_mask=lmask)[0, 4:]
    assert (got_right - plain).abs().max() < 1e-5
    assert (got_left - plain).abs().max() < 1e-5
    assert torch.isfinite(tiny(left, attention_mask=lmask)).all()


@pytest.mark.parametrize("max_shard_bytes", [None, 400_000])
def test_save_load_round_trip_is_exact(tiny: torch.nn.Module, tmp_path: Path, max_shard_bytes: int | None) -> None:
    save_pretrained(tiny, ByteTokenizer(), tmp_path, max_shard_bytes=max_shard_bytes)
    sharded = (tmp_path / "model.safetensors.index.json").is_file()
    assert sharded == (max_shard_bytes is not None)
    if sharded:
        assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) >= 2
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    loaded, tok = load_pretrained(tmp_path)
    assert isinstance(tok, ByteTokenizer)
    for (n1, a), (n2, b) in zip(tiny.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(a, b), n1
    bf16, _ = load_pretrained(tmp_path, dtype=torch.bfloat16)
    assert bf16.lm_head.weight.dtype == torch.bfloat16


def test_tied_embeddings_stay_tied_after_build_load_and_cast(tmp_path: Path) -> None:
    cfg = ModelConfig(
        model_type="qwen2",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=259,
        tie_word_embeddings=True,
        attention_bias=True,
    )
    model, tok = build_tiny(cfg, seed=1)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    save_pretrained(model, tok, tmp_path)
    loaded, _ = load_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, model.model.embed_tokens.weight)
    cast = loaded.to(torch.bfloat16)
    assert cast.lm_head.weight is cast.model.embed_tokens.weight


def test_loading_rejects_mismatched_checkpoints(tiny: torch.nn.Module) -> None:
    state = dict(tiny.state_dict())
    state.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"):
        model_from_state_dict(tiny.config, state)
    state = dict(tiny.state_dict())
    state["model.norm.weight"] = torch.ones(7)
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(7,\)"):
        model_from_state_dict(tiny.config, state)


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(build_tiny("tiny")[0].config.to_hf()))
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"model_type": "gemma"}, "model_type 'gemma'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5}}, "rope type 'yarn'"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "llama3 rope scaling lacks factor"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ],
)
def test_unsupported_configs_are_rejected(patch: dict[str, object], message: str) -> None:
    raw = {**build_tiny("tiny")[0].config.to_hf(), **patch}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(raw)


def test_config_reads_both_rope_spellings() -> None:
    base = build_tiny("tiny")[0].config.to_hf()
    base.pop("rope_parameters")
    v4 = ModelConfig.from_hf({**base, "rope_theta": 1e6})
    v5 = ModelConfig.from_hf(
        {**base, "rope_theta": 1.0, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    )
    assert v4.rope_theta == v5.rope_theta == 1e6
    qwen = ModelConfig.from_hf({**base, "model_type": "qwen2"})
    assert qwen.attention_bias and not qwen.o_proj_bias
