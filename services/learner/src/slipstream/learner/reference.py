"""The frozen reference policy of the KL penalty: the weights the learner started from.

`[loss] kl_coef > 0` penalises the policy's drift from a reference, and the learner computes the
reference's log-probs itself, in a no-grad forward pass over each micro-batch it trains
(`Trainer`). Which weights that pass runs with:

- LoRA (the model has `LoraLinear` layers): the base model, by running the policy itself with
  every adapter's scale at 0 for the pass. No second copy: the base is frozen by construction, so
  it is the initial policy at every step (version 0 computes exactly the base, B = 0).
- Full fine-tuning: a deep copy of the model taken when the trainer is made, before a checkpoint
  is restored, so it holds the `[model]` source's weights (the run's version 0), frozen
  (no gradient, never in the optimizer). A restarted learner makes it again from the same source.

With `kl_coef = 0` (the default) there is no reference and no extra pass.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

from torch import nn

from slipstream.engine.lora import LoraLinear
from slipstream.rl import LossConfig


class Reference:
    """Runs forward passes with the reference weights; `shares_policy` when they are the policy's own module."""

    def __init__(self, module: nn.Module, adapters: list[LoraLinear]) -> None:
        self.module = module
        self.adapters = adapters
        self.shares_policy = bool(adapters)
        """The pass runs the (possibly sharded) policy with its adapters off: every rank must run it."""

    @contextlib.contextmanager
    def active(self) -> Iterator[nn.Module]:
        """The module to run the reference pass with (adapters off for its duration, restored after)."""
        scales = [layer.scale for layer in self.adapters]
        try:
            for layer in self.adapters:
                layer.scale = 0.0
            yield self.module
        finally:
            for layer, scale in zip(self.adapters, scales, strict=True):
                layer.scale = scale


def make_reference(model: nn.Module, loss: LossConfig) -> Reference | None:
    """The reference for `model` under `loss`: None without a KL penalty (see the module docstring)."""
    if loss.kl_coef <= 0:
        return None
    adapters = [m for m in model.modules() if isinstance(m, LoraLinear)]
    if adapters:
        return Reference(model, adapters)
    frozen = copy.deepcopy(model)
    frozen.requires_grad_(False)
    return Reference(frozen, [])
