"""Where `slipstream up --hosts N` puts each process, and the hosts' fault names."""

from __future__ import annotations

import pytest

from slipstream.chaos.hosts_faults import HOST_FAULTS, RAY_FAULTS
from slipstream.chaos.suite import parse_faults
from slipstream.stack.multihost import placement

PIPELINE = ("rollout-worker", "reward-model", "learner", "weight-publisher", "task-source")


def test_three_hosts_put_the_learner_the_scorer_and_the_worker_on_different_hosts() -> None:
    names = ("tool-service", "tool-service-2", *PIPELINE, "weight-publisher-1", "subagent-pool")
    got = placement(names, 3)
    assert got == {
        "tool-service": 1,
        "tool-service-2": 1,
        "rollout-worker": 2,
        "reward-model": 1,
        "learner": 0,
        "weight-publisher": 0,
        "task-source": 1,
        "weight-publisher-1": 0,
        "subagent-pool": 2,
    }


def test_more_hosts_take_the_workers_in_turn_from_the_last() -> None:
    got = placement(("subagent-pool", "subagent-pool-2", "rollout-worker", "learner"), 4)
    assert got == {"subagent-pool": 3, "subagent-pool-2": 2, "rollout-worker": 3, "learner": 0}


def test_fewer_than_three_hosts_is_refused_naming_the_count() -> None:
    with pytest.raises(ValueError, match="at least 3 hosts, got 2"):
        placement(PIPELINE, 2)


def test_the_hosts_schedule_knows_only_the_hosts_faults() -> None:
    assert parse_faults("kill:nats-leader, roll:nats", HOST_FAULTS) == ["kill:nats-leader", "roll:nats"]
    with pytest.raises(ValueError, match=r"unknown fault\(s\) restart:nats; known: kill:nats-leader"):
        parse_faults("restart:nats", HOST_FAULTS)


def test_the_ray_worker_kill_is_known_only_with_ranks_on_a_ray_cluster() -> None:
    assert parse_faults("roll:nats,kill:ray-worker", HOST_FAULTS + RAY_FAULTS) == ["roll:nats", "kill:ray-worker"]
    with pytest.raises(ValueError, match=r"unknown fault\(s\) kill:ray-worker"):
        parse_faults("kill:ray-worker", HOST_FAULTS)
