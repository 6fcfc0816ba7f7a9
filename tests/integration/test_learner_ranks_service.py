"""The learner service with `ranks = 2` against a real nats-server, then resumed with `ranks = 1`.

The 2-rank learner (a Ray driver with 2 FSDP2 rank actors) takes scored groups from the bus,
stages every version, publishes its steps and commits a checkpoint of torch.distributed.checkpoint
files; a single-process learner of the same run resumes from that checkpoint and continues the
version numbers, and every published trajectory is trained exactly once across the two.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from scored_trajectories import group, publish, read_steps

from slipstream.bus import Bus, BusConfig, connect_bus
from slipstream.learner.checkpoint import Pointer
from slipstream.learner.config import LearnerConfig
from slipstream.learner.outcomes import read_outcomes
from slipstream.learner.service import LearnerService
from slipstream.runtime.config import resolve
from slipstream.stack import Server
from slipstream.store import LocalObjectStore
from slipstream.weights.staging import list_staged, load_staged

pytestmark = [
    pytest.mark.integration,
    # Ray's own start-up emits warnings this suite does not own.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.fixture
async def bus(nats_server: Server) -> AsyncIterator[Bus]:
    b = await connect_bus(BusConfig(url=nats_server.url), name="learner-ranks-test")
    await b.ensure_streams()
    yield b
    await b.close()


def settings(tmp_path: Path, url: str, **learner: Any) -> dict[str, dict[str, Any]]:
    return {
        "service": {"run_id": "ranks", "replica": "learner-0"},
        "bus": {"url": url},
        "store": {"root": str(tmp_path / "store")},
        "model": {"preset": "tiny", "seed": 0, "threads": 1},
        "learner": {
            "staging_dir": str(tmp_path / "staging"),
            "outcomes_path": str(tmp_path / "outcomes.jsonl"),
            "max_staleness": 100,
            "announce_timeout_s": 0.3,
            "groups_per_step": 2,
            "checkpoint_every": 2,
            **learner,
        },
    }


async def run_until_done(svc: LearnerService, timeout_s: float) -> None:
    stop = asyncio.Event()
    run = asyncio.create_task(svc.run(stop))
    try:
        await asyncio.wait_for(asyncio.shield(run), timeout_s)  # max_steps reached: run returns by itself
    finally:
        stop.set()
        if not run.done():
            await asyncio.wait_for(run, 30)
        await svc.close()


async def test_two_ranks_train_commit_and_one_process_resumes(nats_server: Server, bus: Bus, tmp_path: Path) -> None:
    groups = [group(f"g{i}") for i in range(6)]
    await publish(bus, [s for g in groups[:4] for s in g])
    two = LearnerService(
        resolve(LearnerConfig, environ={}, overrides=settings(tmp_path, nats_server.url, ranks=2, max_steps=2))
    )
    await two.setup()
    await run_until_done(two, 60)
    assert (two.step, two.committed_step, two.version) == (2, 2, 2)
    store = LocalObjectStore(tmp_path / "store")
    pointer = msgspec.json.decode(store.get("checkpoints/ranks/latest.json"), type=Pointer)
    files = store.list(f"{pointer.chain[0]}/")
    assert f"{pointer.chain[0]}/dcp/.metadata" in files and not any(f.endswith("optimizer.pt") for f in files)

    await publish(bus, [s for g in groups[4:] for s in g])
    one = LearnerService(
        resolve(LearnerConfig, environ={}, overrides=settings(tmp_path, nats_server.url, ranks=1, max_steps=3))
    )
    await one.setup()
    assert (one.step, one.version) == (2, 2)  # resumed from the 2-rank checkpoint
    await run_until_done(one, 60)

    steps = await read_steps(bus, 3, 10)
    assert [(s.step, s.policy_version, s.n_groups, s.n_trajectories) for s in steps] == [
        (1, 1, 2, 8),
        (2, 2, 2, 8),
        (3, 3, 2, 8),
    ]
    assert all(s.grad_norm > 0 for s in steps)
    # The 2 ranks staged their parts of versions 0-2 (disjoint halves of the state); one process stages whole.
    parts = [list_staged(tmp_path / "staging" / f"rank-{r}") for r in range(2)]
    assert [[s.version for s in staged] for staged in parts] == [[0, 1, 2], [0, 1, 2]]
    halves = [set(load_staged(staged[0])) for staged in parts]
    assert halves[0] and halves[1] and not halves[0] & halves[1]
    assert halves[0] | halves[1] == set(load_staged(list_staged(tmp_path / "staging")[0]))
    assert [s.version for s in list_staged(tmp_path / "staging")] == [3]
    trained = sorted(o.trajectory_id for o in read_outcomes(tmp_path / "outcomes.jsonl") if o.outcome == "trained")
    assert trained == sorted(s.trajectory.trajectory_id for g in groups for s in g)
