"""What a live chat stream may send before the completion ends: text no later token can change."""

from __future__ import annotations

import itertools

import pytest

from slipstream.serve.live import settled_text

pytestmark = pytest.mark.unit

STOPS = ["<|im_end|>", "</tool>"]


@pytest.mark.parametrize(
    ("text", "settled"),
    [
        ("Hello", "Hello"),
        ("Hello <|im_", "Hello "),  # may still become <|im_end|>: held back
        ("Hello <|im_end|> and more", "Hello "),  # cut at the stop string
        ("a </to", "a "),
        ("a <", "a "),
        ("a <b>", "a <b>"),  # no stop string starts with "<b": nothing held
        ("caf\ufffd", "caf"),  # an incomplete UTF-8 character waits for its next byte
        ("", ""),
    ],
)
def test_settled_text_holds_back_what_may_still_change(text: str, settled: str) -> None:
    assert settled_text(text, STOPS) == settled


def test_settled_text_grows_monotonically_to_the_cut_text() -> None:
    whole = "The answer is 42.<|im_end|>\nignored"
    seen = [settled_text(whole[:n], STOPS) for n in range(len(whole) + 1)]
    assert all(b.startswith(a) for a, b in itertools.pairwise(seen))
    assert seen[-1] == "The answer is 42."
