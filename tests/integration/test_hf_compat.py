"""Our decoder against transformers' reference: HF checkpoints load into it with identical logits,
and what we save loads back into transformers with identical logits.

transformers is a test-only dependency; the module skips when it is absent. Models are built from
configs with random weights (nothing is downloaded; HF_HUB_OFFLINE is forced on).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from slipstream.engine import ByteTokenizer, build_tiny, load_pretrained, save_pretrained
from slipstream.engine.config import ModelConfig

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.integration

SEED = 1234
TOL = 1e-4

SMALL: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
}


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _hf_model(kind: str, **overrides: Any) -> Any:
    torch.manual_seed(SEED)
    fields = {**SMALL, **overrides}
    if kind == "llama":
        cfg = transformers.LlamaConfig(rope_theta=5000.0, **fields)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(rope_theta=20000.0, **fields)
        model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        # Random init leaves biases at zero; perturb them so the bias path is really compared.
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, vocab, (3, 17), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0  # right padding on one row
    return ids, mask


def _hf_logits(model: Any, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        ("llama", {}),
        ("llama", {"attention_bias": True, "tie_word_embeddings": True}),
        ("qwen2", {}),
        ("qwen2", {"tie_word_embeddings": True}),
    ],
)
def test_hf_checkpoint_loads_with_identical_logits(kind: str, overrides: dict[str, Any], tmp_path: Path) -> None:
    hf = _hf_model(kind, **overrides)
    hf.save_pretrained(tmp_path)
    ByteTokenizer().save(tmp_path)  # a real directory ships a tokenizer; vocab 300 covers the byte ids
    ours, _ = load_pretrained(tmp_path)
    assert ours.config.model_type == kind
    assert ours.config.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    ids, mask = _batch(SMALL["vocab_size"])
    with torch.no_grad():
        got = ours(ids)
        got_masked = ours(ids, attention_mask=mask)
    want = _hf_logits(hf, ids)
    want_masked = _hf_logits(hf, ids, mask)
    assert got.shape == want.shape == (3, 17, SMALL["vocab_size"])
    diff = (got - want).abs().max().item()
    assert diff < TOL, f"{kind} {overrides}: max |logit diff| {diff:.2e} (seed {SEED})"
    valid = mask.bool()
    diff_masked = (got_masked - want_masked)[valid].abs().max().item()
    assert diff_masked < TOL, f"{kind} {overrides} padded: max |logit diff| {diff_masked:.2e} (seed {SEED})"


def test_sharded_hf_checkpoint_loads(tmp_path: Path) -> None:
    hf = _hf_model("llama")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    ByteTokenizer().save(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours, _ = load_pretrained(tmp_path)
    ids, _ = _batch(SMALL["vocab_size"])
    with torch.no_grad():
        diff = (ours(ids) - _hf_logits(hf, ids)).abs().max().item()
    assert diff < TOL, f"sharded load: max |logit diff| {diff:.2e}"


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("sharded", [False, True])
def test_our_save_loads_in_transformers(kind: str, sharded: bool, tmp_path: Path) -> None:
    cfg = ModelConfig.from_hf(
        {"model_type": kind, **SMALL, "rope_theta": 7000.0, "tie_word_embeddings": kind == "qwen2"}
    )
    model, tok = build_tiny(cfg, seed=SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    save_pretrained(model, tok, tmp_path, max_shard_bytes=50_000 if sharded else None)
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == model.config.architecture
    ids, _ = _batch(SMALL["vocab_size"])
    with torch.no_grad():
        diff = (model(ids) - _hf_logits(hf, ids)).abs().max().item()
    assert diff < TOL, f"{kind} reverse: max |logit diff| {diff:.2e} (seed {SEED})"
    # And the round trip through our own loader is exact.
    again, tok2 = load_pretrained(tmp_path)
    assert isinstance(tok2, ByteTokenizer)
    for (name, a), (name2, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert name == name2
        assert torch.equal(a, b), name


def test_saved_byte_tokenizer_loads_in_transformers(tmp_path: Path) -> None:
    model, tok = build_tiny("tiny", seed=0)
    save_pretrained(model, tok, tmp_path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "12+30=42 héllo ✓"
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert hf_tok.eos_token_id == tok.eos_id == 258
    assert hf_tok.pad_token_id == tok.pad_id == 256
    assert hf_tok.decode(tok.encode(text)) == text


def test_transformers_tokenizer_directory_loads_as_hf_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from slipstream.engine import HFTokenizer, load_tokenizer

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(["what is 12 plus 30? it is 42."] * 50, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>", pad_token="<|pad|>")
    fast.save_pretrained(tmp_path)
    ours = load_tokenizer(tmp_path)
    assert isinstance(ours, HFTokenizer)
    assert (ours.eos_id, ours.pad_id) == (fast.eos_token_id, fast.pad_token_id)
    text = "what is 7 plus 5? it is 12."
    ids = fast(text, add_special_tokens=False)["input_ids"]
    assert ours.encode(text) == ids
    assert ours.decode([*ids, ours.eos_id]) == fast.decode(ids, skip_special_tokens=True)
