"""Rank r's actor runs on the Ray node that advertises rank r's custom resource (`[learner] rank_resource`).

In the KubeRay RayJob every GPU worker pod advertises one `slipstream-rank-<r>` and runs the
weight-publisher with `rank = r`: rank r stages its part on its own pod, so it must be the pod
whose publisher stores part r. Here a local Ray cluster of three nodes plays that layout: a head
offering no CPU (the driver's pod) and one node per rank. Rank 1's node offers two CPUs: Ray's
PACK strategy alone (`rank_resource` empty) puts both ranks there, rank 0 on the wrong node.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from slipstream.engine.source import ModelSource
from slipstream.learner.config import LearnerSection
from slipstream.learner.ranks import RankError, RankGroup
from slipstream.rl import LossConfig

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

RESOURCE = "slipstream-rank-{rank}"


@contextmanager
def local_cluster(ranks: tuple[int, ...]) -> Iterator[dict[int, Any]]:
    """A CPU-less head and one node per rank in `ranks` (rank r's with 2 - r CPUs), this process joined."""
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        nodes = {r: c.add_node(num_cpus=2 - r, resources={RESOURCE.format(rank=r): 1}) for r in ranks}
        c.wait_for_nodes()
        ray.init(address=c.address)
        yield nodes
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture
def cluster() -> Iterator[dict[int, Any]]:
    with local_cluster((1, 0)) as nodes:
        yield nodes


def _node_of(actor: Any) -> str:
    import ray

    return str(ray.get(actor.__ray_call__.remote(lambda _self: ray.get_runtime_context().get_node_id())))


def test_each_rank_runs_on_the_node_that_advertises_its_resource(cluster: dict[int, Any]) -> None:
    import ray
    from ray.util.placement_group import placement_group_table

    section = LearnerSection(ranks=2, rank_resource=RESOURCE, rank_start_timeout_s=120.0)
    with RankGroup(ModelSource(preset="tiny", seed=3), section, LossConfig()) as group:
        by_bundle = placement_group_table(group._pg)["bundles_to_node_id"]
        for rank, node in cluster.items():
            assert by_bundle[rank] == node.node_id, (
                f"bundle {rank} is not on the node offering {RESOURCE.format(rank=rank)}"
            )
            assert _node_of(group.actors[rank]) == node.node_id, f"rank {rank}'s actor runs elsewhere"
        # Each rank still holds its resource (and its CPU) while it lives: nothing else can take that node.
        assert ray.available_resources().get(RESOURCE.format(rank=0), 0) == 0


def test_a_rank_whose_resource_no_node_offers_fails_naming_it() -> None:
    # Rank 1's worker pod is missing (not scheduled, or its group advertises another resource).
    section = LearnerSection(ranks=2, rank_resource=RESOURCE, rank_start_timeout_s=5.0)
    with local_cluster((0,)), pytest.raises(RankError, match=r"0 slipstream-rank-1\b"):
        RankGroup(ModelSource(preset="tiny", seed=3), section, LossConfig())
