"""Tokenizers: the byte tokenizer, its tokenizer.json twin, and HF tokenizer directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from slipstream.engine import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

pytestmark = pytest.mark.unit

TEXTS = ["", "12+30=42", "  spaces  and\nnewlines\t", "héllo ✓ 日本語 🎉"]


def test_byte_tokenizer_ids_and_round_trip() -> None:
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 258, 259)
    assert tok.encode("Az") == [65, 122]
    assert tok.encode("é") == [0xC3, 0xA9]
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    # Specials are dropped from text; a cut UTF-8 sequence decodes to the replacement char.
    assert tok.decode([tok.bos_id, 104, 105, tok.eos_id, tok.pad_id]) == "hi"
    assert tok.decode([0xC3]) == "\ufffd"


def test_saved_byte_tokenizer_is_an_equivalent_hf_tokenizer(tmp_path: Path) -> None:
    ByteTokenizer().save(tmp_path)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    hf = HFTokenizer(tmp_path)
    byte = ByteTokenizer()
    assert (hf.pad_id, hf.bos_id, hf.eos_id, hf.vocab_size) == (256, 257, 258, 259)
    for text in TEXTS:
        assert hf.encode(text) == byte.encode(text), text
        assert hf.decode([*byte.encode(text), byte.eos_id]) == text


def _trained_bpe(directory: Path, config: dict[str, object]) -> RawTokenizer:
    tok = RawTokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["the cat sat on the mat", "the dog ate the cat food"] * 20, trainer=trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


def test_hf_tokenizer_reads_special_tokens_from_config(tmp_path: Path) -> None:
    raw = _trained_bpe(
        tmp_path,
        {
            "eos_token": {"content": "<|endoftext|>", "special": True},
            "pad_token": "<|pad|>",
            "bos_token": None,
        },
    )
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_id == raw.token_to_id("<|endoftext|>")
    assert tok.pad_id == raw.token_to_id("<|pad|>")
    assert tok.bos_id is None
    ids = tok.encode("the cat sat")
    assert ids == raw.encode("the cat sat", add_special_tokens=False).ids
    assert len(ids) < len("the cat sat")  # merges were learned, so not byte-per-token
    assert tok.decode([*ids, tok.eos_id]) == "the cat sat"
    # Saving and re-reading keeps the ids.
    out = tmp_path / "copy"
    out.mkdir()
    tok.save(out)
    again = HFTokenizer(out)
    assert (again.eos_id, again.pad_id, again.encode("the dog")) == (tok.eos_id, tok.pad_id, tok.encode("the dog"))


def test_hf_tokenizer_falls_back_to_config_json_and_eos_for_pad(tmp_path: Path) -> None:
    raw = _trained_bpe(tmp_path, {})
    eos = raw.token_to_id("<|endoftext|>")
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [eos, 1], "bos_token_id": None}))
    tok = HFTokenizer(tmp_path)
    assert tok.eos_id == eos
    assert tok.pad_id == eos


def test_hf_tokenizer_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        HFTokenizer(tmp_path)
    _trained_bpe(tmp_path, {})
    with pytest.raises(ValueError, match="no eos token"):
        HFTokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(ValueError, match=r"special token '<\|nope\|>' is not in tokenizer.json"):
        HFTokenizer(tmp_path)
