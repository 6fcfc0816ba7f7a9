"""The idempotency ledger: which trajectory ids are already trained on in a committed checkpoint.

JetStream redelivers a trajectory whose ack never reached the server (the learner died between
committing a checkpoint and sending the acks). Such a redelivery must be acked and counted as a
duplicate, never trained twice. The ledger keeps the ids of the last few committed checkpoints
(one window per checkpoint, the same ones the checkpoint chain retains): acks are sent right
after their checkpoint commits, so an id older than that can no longer come back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class TrainedLedger:
    """Trajectory ids of the last `windows` committed checkpoints."""

    def __init__(self, windows: int) -> None:
        if windows < 1:
            raise ValueError(f"windows must be >= 1, got {windows}")
        self._windows: deque[frozenset[str]] = deque(maxlen=windows)

    def commit(self, ids: Iterable[str]) -> None:
        """Record the ids one newly committed checkpoint covers (the oldest window falls out)."""
        self._windows.append(frozenset(ids))

    def __contains__(self, trajectory_id: object) -> bool:
        return any(trajectory_id in w for w in self._windows)

    def ids(self) -> list[str]:
        """Every id of the retained windows, oldest window first (to re-mark them in the shared ledger)."""
        return [tid for w in self._windows for tid in w]

    def __len__(self) -> int:
        return sum(len(w) for w in self._windows)
