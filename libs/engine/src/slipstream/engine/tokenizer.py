"""Tokenizers: the small protocol the engine needs, a byte tokenizer, and HF `tokenizer.json` files.

`ByteTokenizer` is what the tiny demo model speaks: ids 0..255 are raw UTF-8 bytes, then pad,
bos and eos. It is deterministic and needs no files, yet it can be saved as a real byte-level
`tokenizer.json`, so a saved tiny model is an ordinary HF directory. `HFTokenizer` reads
`tokenizer.json` plus `tokenizer_config.json` / `special_tokens_map.json` from a local directory
with the `tokenizers` package; nothing is ever fetched from a hub. An HF directory's chat
template, when it has one, comes with it (`HFTokenizer.chat_template`, see `slipstream.engine.chat`),
given the directory's special tokens as transformers gives them.

Neither tokenizer adds special tokens in `encode`; callers prepend `bos_id` where a model wants
it. A chat template's text is encoded as it is, with no bos in front: transformers'
`apply_chat_template` does the same (the template writes its own start markers, a bos included
where the model wants one). `decode` drops special tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tokenizers import Tokenizer as _HFTok
from tokenizers import decoders, models, pre_tokenizers

from slipstream.engine.chat import ChatTemplate

# Marker in tokenizer_config.json saying "load me as the ByteTokenizer" (the file also works in HF).
_BYTE_MARKER = "slipstream_byte_tokenizer"


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids, plus the special ids the engine and learner need."""

    @property
    def eos_id(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def bos_id(self) -> int | None: ...
    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then pad=256, bos=257, eos=258 (vocab_size 259)."""

    PAD, BOS, EOS = 256, 257, 258
    SPECIALS = ("<pad>", "<bos>", "<eos>")

    @property
    def eos_id(self) -> int:
        return self.EOS

    @property
    def pad_id(self) -> int:
        return self.PAD

    @property
    def bos_id(self) -> int | None:
        return self.BOS

    @property
    def vocab_size(self) -> int:
        return 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # Ids past the byte range are specials (or, for a model with a padded vocabulary, unused).
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def save(self, directory: str | Path) -> None:
        """Write an HF byte-level tokenizer.json that encodes exactly as this class does."""
        directory = Path(directory)
        mapping = _gpt2_byte_chars()
        vocab = {mapping[b]: b for b in range(256)}
        tok = _HFTok(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(list(self.SPECIALS))
        tok.save(str(directory / "tokenizer.json"))
        config = {
            _BYTE_MARKER: True,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "pad_token": "<pad>",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _gpt2_byte_chars() -> list[str]:
    # GPT-2's printable-character stand-ins for bytes (the ByteLevel pre-tokenizer's alphabet),
    # returned in byte order so byte b maps to token id b.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars: list[str] = []
    extra = 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


class HFTokenizer:
    """A Hugging Face fast tokenizer read from a local directory."""

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {directory}")
        self._tok = _HFTok.from_file(str(path))
        self.directory = directory
        specials = _special_tokens(directory)
        self._bos = self._token_id(specials.get("bos_token"))
        eos = self._token_id(specials.get("eos_token"))
        if eos is None:
            eos = _config_id(directory, "eos_token_id")
        if eos is None:
            raise ValueError(
                f"{directory}: no eos token in tokenizer_config.json, special_tokens_map.json or config.json"
            )
        self._eos = eos
        pad = self._token_id(specials.get("pad_token"))
        if pad is None:
            pad = _config_id(directory, "pad_token_id")
        # Many causal LMs ship without a pad token; eos is the conventional stand-in.
        self._pad = eos if pad is None else pad
        if self._bos is None:
            self._bos = _config_id(directory, "bos_token_id")
        self.eos_token = str(self._tok.id_to_token(self._eos) or "")
        self.chat_template: ChatTemplate | None = ChatTemplate.from_directory(directory, specials)

    def _token_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise ValueError(f"{self.directory}: special token {token!r} is not in tokenizer.json")
        return int(tid)

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def save(self, directory: str | Path) -> None:
        """Copy tokenizer.json and write a tokenizer_config.json naming the special tokens."""
        directory = Path(directory)
        self._tok.save(str(directory / "tokenizer.json"))
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
        for key, tid in (("bos_token", self._bos), ("eos_token", self._eos), ("pad_token", self._pad)):
            if tid is not None:
                config[key] = self._tok.id_to_token(tid)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template.source
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _special_tokens(directory: Path) -> dict[str, str]:
    # tokenizer_config.json wins over special_tokens_map.json; values are strings or AddedToken dicts.
    out: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = directory / name
        if not path.is_file():
            continue
        raw = json.loads(path.read_text())
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = raw.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                out[key] = value
    return out


def _config_id(directory: Path, key: str) -> int | None:
    path = directory / "config.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get(key)
    if isinstance(value, list):
        value = value[0] if value else None
    return None if value is None else int(value)


def load_tokenizer(directory: str | Path) -> ByteTokenizer | HFTokenizer:
    """The tokenizer saved in `directory`: the ByteTokenizer if marked as one, else HFTokenizer."""
    directory = Path(directory)
    config_path = directory / "tokenizer_config.json"
    if config_path.is_file() and json.loads(config_path.read_text()).get(_BYTE_MARKER):
        return ByteTokenizer()
    return HFTokenizer(directory)
