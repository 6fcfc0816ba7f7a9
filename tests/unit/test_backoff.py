"""`slipstream.runtime.backoff.Backoff`: the delays every retry in the repo waits."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time

import pytest

from slipstream.runtime.backoff import Backoff

pytestmark = pytest.mark.unit


def test_delays_double_from_initial_up_to_the_cap() -> None:
    # The pull loops' numbers: 0.1 s doubling, at most 5 s.
    assert list(itertools.islice(Backoff(0.1, max_s=5.0), 8)) == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0])


def test_reset_starts_again_from_initial() -> None:
    b = Backoff(0.5, max_s=4.0)
    assert [next(b), next(b), next(b)] == [0.5, 1.0, 2.0]
    assert b.attempts == 3
    b.reset()
    assert b.attempts == 0
    assert next(b) == 0.5


def test_delay_of_an_attempt_is_stateless_and_matches_the_iterator() -> None:
    b = Backoff(0.25, factor=3.0, max_s=10.0)
    assert [b.delay(n) for n in range(5)] == pytest.approx([0.25, 0.75, 2.25, 6.75, 10.0])
    assert b.attempts == 0
    assert list(itertools.islice(b, 5)) == [b.delay(n) for n in range(5)]


def test_uncapped_delays_survive_huge_attempt_counts() -> None:
    b = Backoff(1.0)
    assert b.delay(10) == 1024.0
    assert b.delay(5000) == math.inf  # 2.0**5000 overflows a float; the (infinite) cap decides
    assert Backoff(1.0, max_s=30.0).delay(5000) == 30.0
    assert Backoff(0.0).delay(5000) == 0.0


def test_jitter_draws_each_delay_from_its_lower_band() -> None:
    seed = 1234
    b = Backoff(1.0, max_s=8.0, jitter=0.5, rng=random.Random(seed))
    got = [next(b) for _ in range(200)]
    plain = [Backoff(1.0, max_s=8.0).delay(n) for n in range(200)]
    for g, p in zip(got, plain, strict=True):
        assert 0.5 * p <= g <= p, f"seed {seed}: {g} outside [{0.5 * p}, {p}]"
    assert len({round(g, 9) for g in got[10:]}) > 100, f"seed {seed}: jitter did not spread the capped delays"
    again = Backoff(1.0, max_s=8.0, jitter=0.5, rng=random.Random(seed))
    assert [next(again) for _ in range(200)] == got


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_s": -0.1},
        {"initial_s": 1.0, "factor": 0.5},
        {"initial_s": 1.0, "max_s": -1.0},
        {"initial_s": 1.0, "jitter": 1.5},
    ],
)
def test_nonsense_parameters_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="need initial_s"):
        Backoff(**kwargs)


def test_a_negative_attempt_is_refused() -> None:
    with pytest.raises(ValueError, match="attempt"):
        Backoff(1.0).delay(-1)


def test_sleep_waits_the_delay_and_advances() -> None:
    async def go() -> tuple[float, float, float]:
        b = Backoff(0.02, max_s=0.05)
        t0 = time.monotonic()
        first = await b.sleep()
        return first, time.monotonic() - t0, await b.sleep()

    first, waited, second = asyncio.run(go())
    assert (first, second) == (0.02, 0.04)
    assert waited >= 0.015


def test_sleep_returns_early_when_stop_is_set() -> None:
    async def go() -> tuple[float, float]:
        stop = asyncio.Event()
        b = Backoff(30.0)
        asyncio.get_running_loop().call_later(0.02, stop.set)
        t0 = time.monotonic()
        due = await b.sleep(stop)
        return due, time.monotonic() - t0

    due, waited = asyncio.run(go())
    assert due == 30.0
    assert waited < 5.0
