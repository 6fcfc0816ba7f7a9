"""Group-relative advantages: how much better one sample did than its siblings.

Each task is sampled `group_size` times; the group's mean reward is the baseline, so no value
network is needed. Following Dr. GRPO / Composer 2, the advantage is the plain difference
A_i = R_i − mean_j(R_j): dividing by the group's standard deviation is available but off by
default, because in a nearly uniform group it turns tiny reward differences into full-size
updates. A group whose rewards are all equal carries no signal (every A_i = 0); the learner drops
it before training and counts the drop (`DropReason.UNIFORM_GROUP`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def _as_rewards(rewards: Tensor | Sequence[float]) -> Tensor:
    """A 1-D floating tensor of finite rewards, or a ValueError naming what is wrong."""
    t = rewards.detach() if isinstance(rewards, Tensor) else torch.as_tensor(list(rewards), dtype=torch.float32)
    if not t.is_floating_point():
        t = t.to(torch.float32)
    if t.dim() != 1:
        raise ValueError(f"rewards must be a 1-D group, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError("rewards is an empty group; a group needs at least one sample")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"rewards must be finite, got {t.tolist()}")
    return t


def group_advantages(
    rewards: Tensor | Sequence[float],
    *,
    normalize_std: bool = False,
    eps: float = 1e-6,
) -> Tensor:
    """Advantage of each sample in one group.

    A_i = R_i − mean(R)                          (default, Dr. GRPO)
    A_i = (R_i − mean(R)) / (std(R) + eps)       (normalize_std=True, original GRPO)

    std is the population standard deviation (divides by n, not n − 1), so a one-sample group
    gets A = 0 instead of NaN. Returns a float tensor of the same length, detached from any
    graph (advantages are constants in the loss).
    """
    r = _as_rewards(rewards)
    centred = r - r.mean()
    if not normalize_std:
        return centred
    if eps <= 0:
        raise ValueError(f"eps must be > 0 when normalize_std is set, got {eps}")
    return centred / (r.std(correction=0) + eps)


def is_uniform_group(rewards: Tensor | Sequence[float], tol: float = 0.0) -> bool:
    """True when the group carries no learning signal: max(R) − min(R) <= tol.

    With tol = 0 only exactly equal rewards count as uniform; a small tol also drops groups whose
    spread is numerical noise (e.g. a graded reward that differs in the sixth decimal).
    """
    if tol < 0:
        raise ValueError(f"tol must be >= 0, got {tol}")
    r = _as_rewards(rewards)
    return float(r.max() - r.min()) <= tol
