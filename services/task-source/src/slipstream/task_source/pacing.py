"""The pacing rule: how many tasks to publish now so rollouts run at most a bounded distance ahead of the learner.

A task becomes one group of `group_size` trajectories; the learner consumes `groups_per_step`
groups per optimizer step. The source keeps at most a window of

    W = groups_per_step × (max_staleness + 1)

groups outstanding, where outstanding counts every unit of work not yet finished anywhere in the
pipeline, read from the work-queue streams (a message leaves a work queue when it is acked):

    outstanding = tasks not yet acked in TASKS
                + (trajectories not yet acked in TRAJ_RAW and TRAJ_SCORED) / group_size

and publishes while outstanding < W. The learner acks dropped trajectories at once, so drops free
the window at once; it holds the acks of trained ones until a checkpoint covers them, so those
(`held_trajectories`) are subtracted: they are done, only their ack waits. Each task carries
min_policy_version = latest − max_staleness, so a worker never samples with weights older than
the learner will accept.

Pure functions over the dicts `Bus.stream_info` returns; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

TASKS_STREAM = "TASKS"
TRAJECTORY_STREAMS = ("TRAJ_RAW", "TRAJ_SCORED")
PACED_STREAMS = (TASKS_STREAM, *TRAJECTORY_STREAMS)
# Below this, a difference of groups is float noise from dividing by group_size.
_EPS = 1e-9


def window(groups_per_step: int, max_staleness: int) -> int:
    """Groups allowed outstanding: one step's worth for every version of staleness the learner accepts."""
    if groups_per_step < 1 or max_staleness < 0:
        raise ValueError(f"need groups_per_step >= 1 and max_staleness >= 0, got {groups_per_step}, {max_staleness}")
    return groups_per_step * (max_staleness + 1)


def unacked(info: Mapping[str, Any]) -> int:
    """Messages of one work-queue stream not yet acked: pending plus ack-pending over its consumers.

    A stream without consumers counts its stored messages (in a work queue, exactly the unacked ones).
    """
    consumers: Mapping[str, Mapping[str, Any]] = info.get("consumers") or {}
    if not consumers:
        return int(info.get("messages", 0))
    return sum(int(c.get("num_pending", 0)) + int(c.get("num_ack_pending", 0)) for c in consumers.values())


def outstanding_groups(infos: Mapping[str, Mapping[str, Any]], group_size: int, *, held_trajectories: int = 0) -> float:
    """Groups in flight: unacked tasks, plus unacked trajectories (less the learner's held ones) / group_size."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    missing = [name for name in PACED_STREAMS if name not in infos]
    if missing:
        raise ValueError(f"stream info missing for {missing}; pacing needs {list(PACED_STREAMS)}")
    trajectories = sum(unacked(infos[name]) for name in TRAJECTORY_STREAMS)
    trajectories = max(0, trajectories - max(0, held_trajectories))
    return unacked(infos[TASKS_STREAM]) + trajectories / group_size


def tasks_to_publish(outstanding_groups: float, window: int) -> int:
    """How many tasks to publish now: enough that outstanding reaches the window (publish while below it)."""
    return max(0, math.ceil(window - outstanding_groups - _EPS))


def min_policy_version(latest: int, max_staleness: int) -> int:
    """The oldest version a worker may sample a new task with (never below version 0)."""
    return max(0, latest - max_staleness)
