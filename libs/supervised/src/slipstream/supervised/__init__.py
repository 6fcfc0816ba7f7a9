"""Slipstream's supervised training: the warm-start that gives RL a policy which sometimes succeeds.

RL learns nothing from a group whose rewards are all equal, and a randomly initialised model
never succeeds; this package trains one, supervised, before RL starts. It plays episodes through
the rollout harness (libs/harness) and never the other way round.

- `ScriptedEngine`: an environment's scripted expert behind the `Engine` protocol (scripted.py).
- `expert_episodes`, `expert_examples`, `episode_examples`: the expert's episodes as training
  rows, one per trainable sample, loss on exactly its sampled tokens (expert.py).
- `copy_examples`: the dense copy curriculum that forms a from-scratch model's induction heads
  (copying.py).
- `read_sft_set`, `sft_set_examples`: the learner's exported RL episodes as warm-start rows
  (sft_set.py, rejection-sampling fine-tuning).
- `sft_warmstart`, `copy_pretrain`, `sft_sequence`: the supervised phase itself (warmstart.py,
  torch: loaded on first use, so importing this package does not pull torch in).
"""

from typing import TYPE_CHECKING, Any

from slipstream.supervised.copying import copy_example, copy_examples
from slipstream.supervised.expert import (
    EXPERT_CHUNK,
    Example,
    episode_examples,
    expert_episodes,
    expert_example_chunks,
    expert_examples,
)
from slipstream.supervised.scripted import ScriptedEngine
from slipstream.supervised.sft_set import SftSetError, read_sft_set, sft_set_examples

_WARMSTART = ("copy_pretrain", "sft_sequence", "sft_warmstart")
if TYPE_CHECKING:
    from slipstream.supervised.warmstart import copy_pretrain, sft_sequence, sft_warmstart


def __getattr__(name: str) -> Any:
    if name in _WARMSTART:
        from slipstream.supervised import warmstart

        return getattr(warmstart, name)
    raise AttributeError(f"module 'slipstream.supervised' has no attribute {name!r}")


__all__ = [
    "EXPERT_CHUNK",
    "Example",
    "ScriptedEngine",
    "SftSetError",
    "copy_example",
    "copy_examples",
    "copy_pretrain",
    "episode_examples",
    "expert_episodes",
    "expert_example_chunks",
    "expert_examples",
    "read_sft_set",
    "sft_sequence",
    "sft_set_examples",
    "sft_warmstart",
]
