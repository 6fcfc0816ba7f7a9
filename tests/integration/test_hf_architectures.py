"""Every supported architecture against transformers, on small random configs, in both forwards.

One model per family is built by transformers itself from `XConfig(...)` (Llama with Llama 3.x's
`llama3` RoPE scaling, Qwen2, Qwen3 with its per-head q/k RMSNorm, Mistral with a sliding window
shorter than the sequence), saved as an HF directory, and loaded by `load_pretrained`. Our logits
must equal transformers' to fp32 rounding:

- the full forward (`model(ids, attention_mask)`), unpadded and with right/left padding;
- the engine's cached forward (`forward_cached`): a prefill of a prefix, then one token per step
  for several rows at once, each at its own position in its own cache slot.

The checks that cannot pass by accident: the scaled RoPE, the q/k norms and the window each
change the logits (asserted), so a model that ignored them would fail. Unsupported config fields
fail at load with one line naming the value and what is supported.

transformers is a test-only dependency; nothing is downloaded (HF_HUB_OFFLINE is forced on).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from slipstream.engine import ByteTokenizer, load_pretrained, save_pretrained
from slipstream.engine.config import ModelConfig, UnsupportedConfig
from slipstream.engine.model import CausalLM

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.integration

SEED = 4321
TOL = 1e-4
SEQ = 19

SMALL: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}
# Llama 3.1's shape of scaling, shrunk so all three bands (kept, interpolated, slowed) occur at head_dim 16.
LLAMA3_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
WINDOW = 5


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _hf_config(kind: str) -> Any:
    if kind == "llama3":
        return transformers.LlamaConfig(rope_parameters=dict(LLAMA3_ROPE), **SMALL)
    if kind == "qwen2":
        return transformers.Qwen2Config(rope_theta=20000.0, **SMALL)
    if kind == "qwen3":
        return transformers.Qwen3Config(head_dim=24, rope_theta=30000.0, tie_word_embeddings=True, **SMALL)
    if kind == "mistral":
        return transformers.MistralConfig(sliding_window=WINDOW, rope_theta=10000.0, **SMALL)
    raise AssertionError(kind)


def _hf_model(kind: str) -> Any:
    torch.manual_seed(SEED)
    cfg = _hf_config(kind)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        # Random init leaves biases at zero and norms at one; perturb them so those paths are compared.
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def _load_ours(kind: str, tmp_path: Path) -> tuple[Any, CausalLM]:
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path)
    ByteTokenizer().save(tmp_path)
    ours, _ = load_pretrained(tmp_path)
    return hf, ours.eval()


def _ids(rows: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED)
    return torch.randint(0, SMALL["vocab_size"], (rows, SEQ), generator=gen)


def _hf_logits(model: Any, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    # Positions count real tokens only, as ours do (transformers' forward would count pads too).
    positions = None if mask is None else (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits


KINDS = ["llama3", "qwen2", "qwen3", "mistral"]
MODEL_TYPE = {"llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral"}


@pytest.mark.parametrize("kind", KINDS)
def test_full_forward_equals_transformers(kind: str, tmp_path: Path) -> None:
    hf, ours = _load_ours(kind, tmp_path)
    cfg = ours.config
    assert cfg.model_type == MODEL_TYPE[kind]
    assert (cfg.rope_scaling is not None) == (kind == "llama3")
    assert cfg.qk_norm == (kind == "qwen3")
    assert cfg.sliding_window == (WINDOW if kind == "mistral" else 0)
    ids = _ids()
    with torch.no_grad():
        got = ours(ids)
    want = _hf_logits(hf, ids)
    diff = (got - want).abs().max().item()
    assert diff < TOL, f"{kind}: max |logit diff| {diff:.2e} (seed {SEED})"

    # Right padding on one row, left padding on another: every real position must still agree.
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    mask[2, :4] = 0
    with torch.no_grad():
        got_masked = ours(ids, attention_mask=mask)
    want_masked = _hf_logits(hf, ids, mask)
    valid = mask.bool()
    diff = (got_masked - want_masked)[valid].abs().max().item()
    assert diff < TOL, f"{kind} padded: max |logit diff| {diff:.2e} (seed {SEED})"


@pytest.mark.parametrize("kind", KINDS)
def test_cached_forward_equals_transformers(kind: str, tmp_path: Path) -> None:
    hf, ours = _load_ours(kind, tmp_path)
    ids = _ids()
    want = _hf_logits(hf, ids)
    cache = ours.new_cache(slots=4, max_seq_len=64)
    # Rows prefill different prefix lengths into slots 3, 0, 2, then decode together, each at its own position.
    starts, slots = [4, 9, 13], [3, 0, 2]
    got = torch.zeros_like(want)
    with torch.no_grad():
        for row, (start, slot) in enumerate(zip(starts, slots, strict=True)):
            got[row, :start] = ours.forward_cached(
                ids[row : row + 1, :start], torch.arange(start)[None], cache, [slot]
            )[0]
        positions = torch.tensor(starts)
        while int(positions.min()) < SEQ:
            live = [r for r in range(3) if positions[r] < SEQ]
            pos = positions[live]
            step = ours.forward_cached(
                ids[live, pos][:, None],
                pos[:, None],
                cache,
                [slots[r] for r in live],
                last=torch.zeros(len(live), dtype=torch.long),
            )
            for i, r in enumerate(live):
                got[r, int(positions[r])] = step[i]
            positions[live] += 1
    diff = (got - want).abs().max().item()
    assert diff < TOL, f"{kind} cached: max |logit diff| {diff:.2e} (seed {SEED})"


def _variant(cfg: ModelConfig, **changes: Any) -> ModelConfig:
    import msgspec

    return msgspec.structs.replace(cfg, **changes)


@pytest.mark.parametrize(
    ("kind", "change"),
    [("llama3", {"rope_scaling": None}), ("qwen3", {"qk_norm": False}), ("mistral", {"sliding_window": 0})],
)
def test_each_family_feature_changes_the_logits(kind: str, change: dict[str, Any], tmp_path: Path) -> None:
    """Without its feature the same weights give other logits: the comparisons above exercise it."""
    _, ours = _load_ours(kind, tmp_path)
    plain = CausalLM(_variant(ours.config, **change))
    state = {k: v for k, v in ours.state_dict().items() if "q_norm" not in k and "k_norm" not in k}
    plain.load_state_dict(state, strict=True)
    ids = _ids(1)
    with torch.no_grad():
        diff = (plain.eval()(ids) - ours(ids)).abs().max().item()
    assert diff > 1e-3, f"{kind}: {change} changed nothing (max diff {diff:.2e})"


@pytest.mark.parametrize("kind", KINDS)
def test_our_save_loads_back_in_transformers(kind: str, tmp_path: Path) -> None:
    _, ours = _load_ours(kind, tmp_path / "in")
    save_pretrained(ours, ByteTokenizer(), tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(hf).__name__ == ours.config.architecture
    ids = _ids()
    with torch.no_grad():
        diff = (ours(ids) - _hf_logits(hf, ids)).abs().max().item()
    assert diff < TOL, f"{kind} saved by us: max |logit diff| {diff:.2e} (seed {SEED})"
    assert ModelConfig.from_hf(json.loads((tmp_path / "out" / "config.json").read_text())) == ours.config


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ({"model_type": "gemma2"}, ["model_type 'gemma2'", "llama, qwen2, qwen3, mistral"]),
        ({"model_type": "llama", "hidden_act": "gelu"}, ["hidden_act 'gelu'", "silu"]),
        ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["'yarn'", "default, llama3"]),
        ({"model_type": "qwen2", "use_sliding_window": True}, ["use_sliding_window", "qwen2"]),
        ({"model_type": "llama", "mlp_bias": True}, ["mlp_bias"]),
    ],
)
def test_unsupported_config_is_one_line_naming_the_value(raw: dict[str, Any], words: list[str], tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**SMALL, **raw}))
    with pytest.raises(UnsupportedConfig) as info:
        load_pretrained(tmp_path)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message
