"""`swarm`: K2.5's Agent Swarm (PARL) on the search corpus (issue 15).

| module | what |
|---|---|
| `options` | the environment's options |
| `tasks` | wide and deep tasks (N items), prompts (`[single]` token), the split (task key or document) |
| `tools` | create_subagent / assign_task and the direct search tools, by mode |
| `steps` | critical and total steps (stages, cohorts) |
| `expert` | the scripted orchestrator (serial or parallel, shared or per-item sub-agents) and theirs |
| `env` | the registered environment `swarm` (episode loop, reward components, metrics) |
"""

from slipstream.envs.swarm.env import COMPONENTS, Swarm
from slipstream.envs.swarm.options import SwarmOptions
from slipstream.envs.swarm.steps import Ledger, Stage, critical_steps, total_steps

__all__ = ["COMPONENTS", "Ledger", "Stage", "Swarm", "SwarmOptions", "critical_steps", "total_steps"]
