"""`[learner] rank_resource`: the placement group's bundles and the config's checks (no Ray started).

That the bundles put each rank on the node advertising its resource is shown on a real local Ray
cluster in tests/integration/test_learner_ranks_placement.py.
"""

from __future__ import annotations

import pytest

from slipstream.learner.config import LearnerSection
from slipstream.learner.ranks import rank_bundles

pytestmark = pytest.mark.unit


def test_without_a_rank_resource_each_bundle_asks_for_one_cpu_only() -> None:
    assert rank_bundles(3) == [{"CPU": 1.0}] * 3
    assert LearnerSection().rank_resource == ""


def test_bundle_r_asks_for_one_unit_of_rank_rs_resource() -> None:
    assert rank_bundles(3, "slipstream-rank-{rank}") == [
        {"CPU": 1.0, "slipstream-rank-0": 1.0},
        {"CPU": 1.0, "slipstream-rank-1": 1.0},
        {"CPU": 1.0, "slipstream-rank-2": 1.0},
    ]


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("slipstream-rank", "must contain '{rank}'"),
        ("rank-{rank}-{node}", "not a template with only '{rank}'"),
        ("rank-{rank}-{0}", "not a template with only '{rank}'"),
    ],
)
def test_a_template_that_does_not_name_each_rank_is_refused(template: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LearnerSection(ranks=2, rank_resource=template)
