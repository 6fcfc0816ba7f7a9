"""HttpEngine's bookkeeping without a socket: which server answer its version and counters follow,
and what it refuses before anything is sent."""

from __future__ import annotations

import pytest

from slipstream.engine.backend import EngineBackend
from slipstream.serve.http_engine import HttpEngine

pytestmark = pytest.mark.unit


def _stats(updates: int, steps: int) -> dict[str, float]:
    return {"weight_updates": float(updates), "steps": float(steps)}


def test_a_late_answer_never_moves_the_version_back() -> None:
    engine = HttpEngine("http://127.0.0.1:1")
    engine._note(0, _stats(0, 10), "a")
    # The update is counted inside step 11, before the step is: its answer says (1, 10).
    engine._note(1, _stats(1, 10), "a")
    assert engine.policy_version == 1
    engine._note(0, _stats(0, 10), "a")  # a generate answer built just before the update, arriving late
    assert engine.policy_version == 1
    engine._note(1, _stats(1, 12), "a")
    assert engine.stats()["steps"] == 12
    # A rollback is an update like any other: more updates applied, a lower version.
    engine._note(0, _stats(2, 12), "a")
    assert engine.policy_version == 0


def test_a_restarted_server_is_never_taken_for_the_same_one() -> None:
    engine = HttpEngine("http://127.0.0.1:1")
    engine._note(0, _stats(0, 3), "a")
    engine._note(7, _stats(7, 90), "a")
    # Restarted: counters from zero, version 0 weights. Neither ignored as stale nor believed.
    engine._note(0, _stats(0, 2), "b")
    assert engine.policy_version == 7
    assert engine._lost is not None and "restarted (server id a -> b)" in str(engine._lost)


def test_config_and_lifecycle_errors_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="needs url"):
        EngineBackend(type="http")
    with pytest.raises(ValueError, match="type = 'http'"):
        HttpEngine.from_config(EngineBackend())
    engine = HttpEngine.from_config(EngineBackend(type="http", url="http://inference-0:8100/", request_timeout_s=5))
    assert (engine.url, engine.request_timeout_s) == ("http://inference-0:8100", 5)
    with pytest.raises(RuntimeError, match=r"http://inference-0:8100.*start\(\)"):
        engine.apply_weights(1, {})
