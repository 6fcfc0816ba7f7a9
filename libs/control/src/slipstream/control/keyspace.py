"""Every Redis key the control plane uses, in one place.

Keys look like `slipstream:{<run_id>}:<name>`. The braces make the run id a Redis Cluster hash
tag: all of a run's keys live in one slot, so the multi-key Lua scripts (ledger claims,
promotions) work unchanged on a cluster, and two runs never share a key.
"""

from __future__ import annotations

import re

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


class Keyspace:
    """The keys of one run."""

    def __init__(self, run_id: str) -> None:
        if not _RUN_ID.match(run_id):
            raise ValueError(
                f"run_id {run_id!r} is not usable as a key namespace: use 1-128 characters from "
                "letters, digits and '._:-', starting with a letter or digit"
            )
        self.run_id = run_id
        self.prefix = f"slipstream:{{{run_id}}}"

    def key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    @property
    def lease(self) -> str:
        """String `<token>:<holder_id>` with a TTL: who leads the learner, under which token."""
        return self.key("lease")

    @property
    def fence(self) -> str:
        """Integer, INCR'd on every lease acquisition: the fencing token counter (never reset)."""
        return self.key("lease", "fence")

    def ledger(self, trajectory_id: str) -> str:
        """String `<step>` with a TTL: the trajectory was counted by that learner step."""
        return self.key("ledger", trajectory_id)

    def task(self, task_key: str) -> str:
        """Hash {attempts, solved, reward_sum}: statistics of one task."""
        return self.key("task", task_key)

    @property
    def evals(self) -> str:
        """List of JSON EvalResults in the order they were recorded."""
        return self.key("evals")

    @property
    def evals_by_version(self) -> str:
        """Hash policy_version -> JSON EvalResult (the latest evaluation of that version)."""
        return self.key("evals", "by_version")

    @property
    def promoted(self) -> str:
        """String: the promoted policy_version."""
        return self.key("promoted")

    @property
    def promotion_stack(self) -> str:
        """List of promoted versions, oldest first; the last one is the promoted version."""
        return self.key("promoted", "stack")

    @property
    def promotion_log(self) -> str:
        """List of JSON Promotion records (promote and rollback), oldest first."""
        return self.key("promoted", "log")
