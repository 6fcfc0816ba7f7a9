"""A dead letter always fits the bus: original headers kept, dropped, or the body cut with the cut recorded."""

from __future__ import annotations

import hashlib

import pytest

from slipstream.bus import dlq
from slipstream.bus.envelope import wire_size
from slipstream.schemas.dead_letter import H_ORIGINAL_SHA256, H_ORIGINAL_SIZE, DeadLetter

pytestmark = pytest.mark.unit
LIMIT = 4096


def headers(original: dict[str, str] | None) -> dict[str, str]:
    return dlq.dead_letter_headers(
        original,
        kind="decode",
        detail="cannot decode Episode: bad",
        subject="traj.raw.arith",
        stream="TRAJ_RAW",
        consumer="reward-model",
        deliveries=1,
        sequence=42,
    )


def test_a_small_message_keeps_its_body_and_headers() -> None:
    original = {"Slipstream-Schema": "Episode/1", "traceparent": "00-" + "a" * 50}
    body, hdrs, cut = dlq.fit(b"x" * 100, headers(original), headers(None), LIMIT)
    assert (body, cut) == (b"x" * 100, 0)
    assert hdrs["traceparent"] == original["traceparent"]


def test_original_headers_are_dropped_before_the_body_is_cut() -> None:
    original = {"X-Big": "h" * 1000}
    data = b"y" * (LIMIT - wire_size(b"", headers(None)) - 10)
    body, hdrs, cut = dlq.fit(data, headers(original), headers(None), LIMIT)
    assert (body, cut) == (data, 0)
    assert "X-Big" not in hdrs and H_ORIGINAL_SIZE not in hdrs


def test_a_body_just_under_the_limit_is_cut_to_fit_and_the_cut_recorded() -> None:
    data = bytes(range(256)) * (LIMIT // 256)  # the whole limit: no room for any dead-letter header
    data = data[: LIMIT - 20]
    body, hdrs, cut = dlq.fit(data, headers({"Slipstream-Schema": "Episode/1"}), headers(None), LIMIT)
    assert wire_size(body, hdrs) == LIMIT
    assert cut == len(data) - len(body) > 0
    assert data.startswith(body)
    letter = DeadLetter.from_message(body, hdrs)
    assert letter.cut and letter.original_size == len(data)
    assert letter.original_sha256 == hashlib.sha256(data).hexdigest() == hdrs[H_ORIGINAL_SHA256]
    assert letter.reason.startswith("decode:") and letter.sequence == 42
    assert not DeadLetter.from_message(b"abc", headers(None)).cut
