"""Slipstream's rollout harness: one rollout loop for training, eval-gate and serving.

- `rollout_episodes`: a task played `group_size` times by its environment's own loop -> Episodes;
  `rollout_group` is the same for one-sample environments, as v1 Trajectories.
- `RecordingEngine`, `token_problems`: proof that an episode's ids came from the engine and the
  tokenizer only (the invariant suite runs it on every environment).
- `evaluate`: held-out accuracy and reward of an engine's current weights, via the same loop.
- `play_subagent`, `merge_reply`: frozen sub-agents played by a pinned pool (pool.py), merged back
  (subagents.py).
- `sft_warmstart`: a short supervised phase so RL starts from a policy that sometimes succeeds.
"""

from typing import TYPE_CHECKING, Any

from slipstream.harness.episode import EpisodeRun, Recorder
from slipstream.harness.evaluate import EvalReport, TaskEval, evaluate, greedy_params
from slipstream.harness.pool import play_subagent
from slipstream.harness.provenance import EngineCall, RecordingEngine, token_problems
from slipstream.harness.rollout import (
    RolloutAborted,
    RolloutError,
    TaskRejected,
    as_spec,
    completion_seed,
    new_group_id,
    play_episode,
    prompt_ids,
    rollout_episodes,
    rollout_group,
    trajectory_of,
)
from slipstream.harness.scripted import ScriptedEngine
from slipstream.harness.state import EpisodeState, SampleBuilder
from slipstream.harness.subagents import SubagentTransport, build_request, merge_reply
from slipstream.harness.summarising import SummarisingContext
from slipstream.harness.summary import SummaryConfig, group_threshold

# The warm-start trains with torch; it loads on first use so that importing the harness (a
# service's config, `--help`) does not pull torch in.
_WARMSTART = ("episode_examples", "expert_episodes", "expert_examples", "sft_sequence", "sft_warmstart")
if TYPE_CHECKING:
    from slipstream.harness.warmstart import (
        episode_examples,
        expert_episodes,
        expert_examples,
        sft_sequence,
        sft_warmstart,
    )


def __getattr__(name: str) -> Any:
    if name in _WARMSTART:
        from slipstream.harness import warmstart

        return getattr(warmstart, name)
    raise AttributeError(f"module 'slipstream.harness' has no attribute {name!r}")


__all__ = [
    "EngineCall",
    "EpisodeRun",
    "EpisodeState",
    "EvalReport",
    "Recorder",
    "RecordingEngine",
    "RolloutAborted",
    "RolloutError",
    "SampleBuilder",
    "ScriptedEngine",
    "SubagentTransport",
    "SummarisingContext",
    "SummaryConfig",
    "TaskEval",
    "TaskRejected",
    "as_spec",
    "build_request",
    "completion_seed",
    "episode_examples",
    "evaluate",
    "expert_episodes",
    "expert_examples",
    "greedy_params",
    "group_threshold",
    "merge_reply",
    "new_group_id",
    "play_episode",
    "play_subagent",
    "prompt_ids",
    "rollout_episodes",
    "rollout_group",
    "sft_sequence",
    "sft_warmstart",
    "token_problems",
    "trajectory_of",
]
