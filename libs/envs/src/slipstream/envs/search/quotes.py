"""Extraction-based verification's quote matching: the normalisation cascade.

A quote (from a supporting document, a clue, or the answer) counts as present in a source text
when any step of the cascade finds it, tried in order (after Context-1's data-gen `verify.py`):

1. case-insensitive substring;
2. whitespace collapsed (runs of spaces, tabs and newlines are one space);
3. links stripped (markdown `[text](url)` keeps `text`; bare URLs removed);
4. unicode normalised: NFKC, smart quotes and dashes folded to ASCII, punctuation removed;
5. fallback: the first 5 words longer than 3 letters, in order, with anything between them
   (only when the quote has at least 3 such words).

`quote_step` says which step matched (for counting); `quote_in` is the yes/no.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Sequence

_SPACE = re.compile(r"\s+")
_MD_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
_URL = re.compile(r"https?://\S+|www\.\S+")
_PUNCT = re.compile(r"[^\w\s]")
_WORD = re.compile(r"\w+")
_FOLD = str.maketrans(
    {
        "\u2018": "'", "\u2019": "'", "\u201a": "'", "\u201b": "'",
        "\u201c": '"', "\u201d": '"', "\u201e": '"', "\u201f": '"',
        "\u2010": "-", "\u2011": "-", "\u2012": "-", "\u2013": "-", "\u2014": "-", "\u2015": "-", "\u2212": "-",
        "\u00a0": " ",
    }
)  # fmt: skip

STEPS: tuple[str, ...] = ("case", "whitespace", "links", "unicode", "first_words")


def _collapse(text: str) -> str:
    return _SPACE.sub(" ", text).strip().lower()


def _strip_links(text: str) -> str:
    return _collapse(_URL.sub(" ", _MD_LINK.sub(r"\1", text)))


def _unicode(text: str) -> str:
    folded = unicodedata.normalize("NFKC", text).translate(_FOLD)
    return _collapse(_PUNCT.sub(" ", _strip_links(folded)))


def _first_words(quote: str, text: str) -> bool:
    words = [w for w in _WORD.findall(_unicode(quote)) if len(w) > 3][:5]
    if len(words) < 3:
        return False
    pattern = r"\b" + r"\b.*?\b".join(re.escape(w) for w in words) + r"\b"
    return re.search(pattern, _unicode(text), re.DOTALL) is not None


def quote_step(quote: str, text: str) -> str | None:
    """The first cascade step that finds `quote` in `text`, or None when none does."""
    if not quote.strip():
        return None
    if quote.lower() in text.lower():
        return "case"
    if _collapse(quote) in _collapse(text):
        return "whitespace"
    if (q := _strip_links(quote)) and q in _strip_links(text):
        return "links"
    if (q := _unicode(quote)) and q in _unicode(text):
        return "unicode"
    if _first_words(quote, text):
        return "first_words"
    return None


def quote_in(quote: str, text: str) -> bool:
    """Whether `quote` is found in `text` by any step of the cascade."""
    return quote_step(quote, text) is not None


def required_matches(n_quotes: int) -> int:
    """How many of `n_quotes` must match: ceil(2/3 n) (Context-1's `min_required_matches`)."""
    return math.ceil(2 * n_quotes / 3)


def enough_quotes(quotes: Sequence[str], text: str) -> bool:
    """At least ceil(2/3) of `quotes` are in `text` (and there is at least one quote)."""
    if not quotes:
        return False
    return sum(quote_in(q, text) for q in quotes) >= required_matches(len(quotes))


def answer_in(answer: str, text: str) -> bool:
    """Whether any form of `answer` is in `text`: steps 1-4 on word boundaries (no first-words fallback,
    which would accept unrelated text for a long answer)."""
    a = _unicode(answer)
    return bool(a) and re.search(rf"\b{re.escape(a)}\b", _unicode(text)) is not None
