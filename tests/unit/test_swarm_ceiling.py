"""The swarm's accuracy ceiling (swarm_eval.ceiling): the teacher's orchestrator, parallel on every
task, over the arm's frozen sub-agents.

The orchestrator is scripted, so what the ceiling measures is the sub-agents: an untrained model's
find nothing (accuracy 0 though every episode runs all N sub-agents in one turn), the search
teacher's find everything (accuracy 1). A swarm's accuracy is the product of its sub-agents'
per-item successes, which RL on the orchestrator does not train; the ceiling says how much of it
RL could earn at most.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import search_backend  # noqa: F401  (registers the "terms" backend)
from test_swarm_env import SEARCH

from slipstream.run import swarm_eval
from slipstream.run.presets import demo_plan

pytestmark = pytest.mark.unit

OPTIONS = {
    "search": {**SEARCH, "expert_grep": True},
    "item_counts": [2],
    "max_critical_steps": 4,
    "expert_subagents": "per_item",
    "expert_parallel_rate": 0.0,  # the warm-start's teacher: serial; the ceiling makes it parallel
    "by_reference": True,
    "cite": "all",
}


@pytest.fixture(scope="module")
def arm(tmp_path_factory: pytest.TempPathFactory) -> swarm_eval.ArmModel:
    from slipstream.engine import build_tiny, save_pretrained

    model, tokenizer = build_tiny("micro", seed=0)
    path = tmp_path_factory.mktemp("model")
    save_pretrained(model, tokenizer, path)
    return swarm_eval.ArmModel(mode="swarm", env_options=OPTIONS, model_dir=Path(path))


def test_an_untrained_models_sub_agents_find_nothing_under_a_parallel_orchestrator(
    arm: swarm_eval.ArmModel,
) -> None:
    lines: list[str] = []
    out = swarm_eval.ceiling(arm, demo_plan("swarm"), tasks=2, samples=1, seed=0, emit=lines.append)
    for split in ("heldout", "train"):
        row = out[split]
        # every episode: one turn creating and assigning both items, so parallel, 2 sub-agents
        assert row["parallel_rate"] == 1.0 and row["subagents"] == 2.0
        assert row["accuracy"] == 0.0
    assert len(lines) == 2 and lines[0].startswith("ceiling heldout")


def test_the_search_teachers_sub_agents_reach_accuracy_1(
    arm: swarm_eval.ArmModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slipstream.envs.swarm.expert import item_task
    from slipstream.envs.swarm.tasks import items_of
    from slipstream.supervised import ScriptedEngine

    env = swarm_eval._env(arm)
    tasks = [t for split in ("heldout", "train") for t in env.generate(split, 2, 0)]
    entered = swarm_eval._Engines.__aenter__

    async def scripted_sub_agents(self: Any) -> Any:
        await entered(self)

        def sub_agent(_request: Any, context: str) -> str:
            # a sub-agent's context holds its item's question: the search teacher's next line
            for t in tasks:
                for item in items_of(t.metadata):
                    if item.question in context:
                        return str(env.search.expert(item_task(t, item), context))
            raise AssertionError(f"no item's question in a sub-agent's context: {context[:200]!r}")

        self.frozen = ScriptedEngine(self.tokenizer, sub_agent, max_seq_len=4096)
        return self

    monkeypatch.setattr(swarm_eval._Engines, "__aenter__", scripted_sub_agents)
    out = swarm_eval.ceiling(arm, demo_plan("swarm"), tasks=2, samples=1, seed=0, emit=lambda _m: None)
    assert out["heldout"]["accuracy"] == 1.0 and out["train"]["accuracy"] == 1.0
    assert out["heldout"]["critical_steps"] <= 4


def test_the_single_agent_has_no_ceiling_of_this_kind(arm: swarm_eval.ArmModel) -> None:
    single = swarm_eval.ArmModel(mode="single", env_options=OPTIONS, model_dir=arm.model_dir)
    with pytest.raises(ValueError, match="not mode 'single'"):
        swarm_eval.ceiling(single, demo_plan("swarm"), tasks=1, samples=1, seed=0)
