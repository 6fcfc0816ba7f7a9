"""Slipstream's rollout harness: one rollout loop for training, eval-gate and serving.

- `rollout_episodes`: a task played `group_size` times by its environment's own loop -> Episodes;
  `rollout_group` is the same for one-sample environments, as v1 Trajectories.
- `RecordingEngine`, `token_problems`: proof that an episode's ids came from the engine and the
  tokenizer only (the invariant suite runs it on every environment).
- `evaluate`: held-out accuracy and reward of an engine's current weights, via the same loop.
- `play_subagent`, `merge_reply`: frozen sub-agents played by a pinned pool (pool.py), merged back
  (subagents.py).

The supervised warm-start built on this loop (a scripted expert's episodes, `sft_warmstart`) is its
own package, libs/supervised (`slipstream.supervised`).
"""

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
from slipstream.harness.state import EpisodeState, SampleBuilder
from slipstream.harness.subagents import SubagentTransport, build_request, merge_reply
from slipstream.harness.summarising import SummarisingContext
from slipstream.harness.summary import SummaryConfig, group_threshold

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
    "SubagentTransport",
    "SummarisingContext",
    "SummaryConfig",
    "TaskEval",
    "TaskRejected",
    "as_spec",
    "build_request",
    "completion_seed",
    "evaluate",
    "greedy_params",
    "group_threshold",
    "merge_reply",
    "new_group_id",
    "play_episode",
    "play_subagent",
    "prompt_ids",
    "rollout_episodes",
    "rollout_group",
    "token_problems",
    "trajectory_of",
]
