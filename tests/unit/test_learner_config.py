"""The learner's config (env-only, validation) and where a restarted learner's versions continue."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.bus import BusConfig, connect_bus, reset_memory_brokers
from slipstream.learner.config import LearnerConfig
from slipstream.learner.resume import current_version, last_announced, last_published
from slipstream.learner.service import learner_streams
from slipstream.runtime.config import ConfigError, resolve
from slipstream.schemas import WeightAnnounce
from slipstream.schemas.subjects import STREAMS, WEIGHTS_ANNOUNCE
from slipstream.store import LocalObjectStore
from slipstream.weights.layout import manifest_key, shard_key

pytestmark = pytest.mark.unit


def test_the_whole_config_can_come_from_the_environment() -> None:
    env = {
        "SLIPSTREAM_SERVICE__RUN_ID": "r1",
        "SLIPSTREAM_MODEL__PRESET": "tiny",
        "SLIPSTREAM_MODEL__THREADS": "1",
        "SLIPSTREAM_LOSS__TYPE": "cispo",
        "SLIPSTREAM_LEARNER__MAX_STEPS": "8",
        "SLIPSTREAM_LEARNER__BETAS": "[0.9, 0.95]",
        "SLIPSTREAM_LEARNER__NORMALIZE_STD": "true",
        "SLIPSTREAM_LEARNER__STAGING_DIR": "/tmp/stage",
        "SLIPSTREAM_LEARNER__WEIGHTS_DTYPE": "bfloat16",
        "SLIPSTREAM_REWARD__CONCURRENCY": "4",  # another service's section in a shared env file: skipped
    }
    cfg = resolve(LearnerConfig, environ=env)
    assert cfg.service.run_id == "r1" and cfg.loss.type == "cispo"
    assert (cfg.learner.max_steps, cfg.learner.betas, cfg.learner.normalize_std) == (8, (0.9, 0.95), True)
    assert (cfg.learner.staging_dir, cfg.learner.weights_dtype) == ("/tmp/stage", "bfloat16")


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("GROUPS_PER_STEP", "0", "groups_per_step must be >= 1"),
        ("MAX_STALENESS", "-1", "max_staleness must be >= 0"),
        ("BETAS", "[0.9, 1.0]", "betas must be in [0, 1)"),
        ("SAMPLING_TEMPERATURE", "0", "sampling_temperature must be > 0"),
        ("KEEP_CHECKPOINTS", "0", "keep_checkpoints must be >= 1"),
        ("WEIGHTS_DTYPE", "int8", "learner.weights_dtype"),
    ],
)
def test_bad_values_are_rejected_naming_the_field(key: str, value: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve(LearnerConfig, environ={f"SLIPSTREAM_LEARNER__{key}": value})
    assert needle in str(err.value)


def test_an_unknown_learner_key_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"unknown key learner\.max_step"):
        resolve(LearnerConfig, environ={"SLIPSTREAM_LEARNER__MAX_STEP": "3"})


def test_the_ack_wait_override_touches_only_the_learner_durable() -> None:
    assert learner_streams(0.0) is STREAMS
    patched = {c.durable: c for s in learner_streams(5.0) for c in s.consumers}
    original = {c.durable: c for s in STREAMS for c in s.consumers}
    assert patched["learner"].ack_wait_s == 5.0 and original["learner"].ack_wait_s == 20.0
    assert {k: v for k, v in patched.items() if k != "learner"} == {k: v for k, v in original.items() if k != "learner"}
    assert patched["learner"].max_ack_pending == original["learner"].max_ack_pending


def test_versions_continue_after_the_highest_known_anywhere() -> None:
    assert current_version(checkpoint=-1, announced=-1, published=-1, staged=-1) == -1  # fresh run
    assert current_version(checkpoint=4, announced=-1, published=-1, staged=5) == 5  # staged, not yet published
    assert current_version(checkpoint=4, announced=6, published=7, staged=-1) == 7  # announce lost after manifest


def test_last_published_reads_committed_manifests_of_the_run_only(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    assert last_published(store, "r") == -1
    for run, version in (("r", 2), ("r", 11), ("other", 40)):
        store.put(manifest_key(run, version), b"{}")
    store.put(shard_key("r", 12, 0), b"shard without manifest: not committed")
    assert last_published(store, "r") == 11


async def test_last_announced_reads_the_newest_announce_of_this_run() -> None:
    reset_memory_brokers()
    bus = await connect_bus(BusConfig(type="memory", url="memory://learner-resume"), name="t")
    try:
        await bus.ensure_streams()
        assert await last_announced(bus, "r", 0.2) == -1  # nothing announced yet
        for run, version in (("r", 3), ("r", 5)):
            key = manifest_key(run, version)
            await bus.publish(WEIGHTS_ANNOUNCE, WeightAnnounce(policy_version=version, manifest_key=key, run_id=run))
        assert await last_announced(bus, "r", 2.0) == 5
        assert await last_announced(bus, "r", 0.0) == -1  # disabled
        other = WeightAnnounce(policy_version=9, manifest_key=manifest_key("x", 9), run_id="x")
        await bus.publish(WEIGHTS_ANNOUNCE, other)
        assert await last_announced(bus, "r", 2.0) == -1  # another run's announce is not ours
    finally:
        await bus.close()
        reset_memory_brokers()
