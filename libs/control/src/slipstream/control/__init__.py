"""Slipstream control plane in Redis: leader lease + fencing token, idempotency ledger, task
statistics, eval history and the promoted version (README.md has the keys and the failure story).
"""

from slipstream.control.client import ControlClient, ControlError, ControlUnavailable, redact_url
from slipstream.control.control import Control, connect_control
from slipstream.control.eval_history import EvalHistory, Promotion
from slipstream.control.keyspace import Keyspace
from slipstream.control.lease import LeaderLease, LeaseHeld, LeaseInfo, default_holder_id
from slipstream.control.ledger import Ledger
from slipstream.control.task_stats import ALWAYS_SOLVED, NEVER_SOLVED, TaskStat, TaskStats, skip_reason

__all__ = [
    "ALWAYS_SOLVED",
    "NEVER_SOLVED",
    "Control",
    "ControlClient",
    "ControlError",
    "ControlUnavailable",
    "EvalHistory",
    "Keyspace",
    "LeaderLease",
    "LeaseHeld",
    "LeaseInfo",
    "Ledger",
    "Promotion",
    "TaskStat",
    "TaskStats",
    "connect_control",
    "default_holder_id",
    "redact_url",
    "skip_reason",
]
