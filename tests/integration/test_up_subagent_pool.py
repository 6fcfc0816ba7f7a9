"""`slipstream up --subagent-pool N`: the local stack starts pinned pool replicas as real processes.

A `Stack` with one rollout worker and 2 pool replicas (each its own `python -m
slipstream.rollout_worker` process, connecting as the `subagent-pool` bus user on a nats-server
that enforces the generated permissions): every replica reports the pool mode at the pinned
version on /readyz, the worker reports `[subagents] transport = "nats"`, and sub-agent requests
sent as the rollout-worker user (publish to subagents.<env>, replies into its own inbox) are
answered by the replicas, both of them, each at the pinned version.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from slipstream.bus import connect_bus
from slipstream.envs import get_env
from slipstream.rollout_worker.subagent_client import NatsSubagents
from slipstream.schemas import SubagentRequest, SubagentSampling
from slipstream.stack.local import Stack
from slipstream.stack.spec import StackSpec

pytestmark = pytest.mark.integration

REQUESTS = 8


def _status(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
        return dict(json.loads(r.read())["status"])


async def _ask_pool(stack: Stack) -> NatsSubagents:
    bus = await connect_bus(stack.service_bus("rollout-worker", stream_storage="memory"), name="test-orchestrator")
    try:
        client = NatsSubagents(bus, timeout_s=60.0, retries=0, caller="test-orchestrator")
        lookup = get_env("lookup")
        tasks = lookup.generate("train", REQUESTS, seed=2)
        replies = await asyncio.gather(
            *(
                client.run(
                    SubagentRequest(
                        request_id=f"ep/0/sub{i}",
                        agent_id=f"sub{i}",
                        env="lookup",
                        task_id=t.task_id,
                        prompt=t.prompt,
                        reference=t.reference,
                        split=t.split,
                        sampling=SubagentSampling(max_tokens=8),
                        seed=i,
                    )
                )
                for i, t in enumerate(tasks)
            )
        )
        assert [r.error for r in replies] == [""] * REQUESTS
        assert all(r.samples and r.samples[0].agent_id == r.request_id.rsplit("/", 1)[1] for r in replies)
        return client
    finally:
        await bus.close()


def test_up_starts_pinned_pool_replicas_that_answer_the_workers(tmp_path: Path) -> None:
    spec = StackSpec(
        run_dir=tmp_path / "run",
        services=("rollout-worker",),
        run_id="run",
        subagent_pool=2,
        pin_version=0,
        ready_timeout_s=180.0,
        env={"SLIPSTREAM_POOL__MAX_IN_FLIGHT": "2", "SLIPSTREAM_MODEL__THREADS": "1"},
    )
    with Stack(spec) as stack:
        stack.wait_ready()
        assert sorted(stack.services) == ["rollout-worker", "subagent-pool", "subagent-pool-2"]
        for name in ("subagent-pool", "subagent-pool-2"):
            status = _status(stack.services[name].port)
            assert status["pool"]["worker_id"] == f"rollout-worker/{name}"
            assert status["pool"]["policy_version"] == 0 and status["weights"]["pinned"] is True
        assert _status(stack.services["rollout-worker"].port)["subagents"]["transport"] == "nats"
        client = asyncio.run(_ask_pool(stack))
    assert set(client.served_by) == {"rollout-worker/subagent-pool", "rollout-worker/subagent-pool-2"}
    assert sum(client.served_by.values()) == REQUESTS and dict(client.versions) == {0: REQUESTS}
    assert stack.exit_codes == {"rollout-worker": 0, "subagent-pool": 0, "subagent-pool-2": 0}
