"""The outcome log: one JSON line per trajectory the learner settled, and how.

Written just before the acks it describes: a trained trajectory when the checkpoint covering its
step is committed (never earlier, so a step lost in a crash leaves no line), a dropped one when
it is dropped, with the reason (duplicate included). A learner killed after its commit but before
the lines were written leaves them missing; the next one writes them when it resumes from that
checkpoint (`restore_trained`, from the ids and sequences the checkpoint holds). Read by audits
and by the crash test to show that every published trajectory was trained exactly once or
dropped with a reason. Off unless `[learner] outcomes_path` is set.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

import msgspec

TRAINED = "trained"
DROPPED = "dropped"


class Outcome(msgspec.Struct, kw_only=True):
    """One line of the log."""

    trajectory_id: str
    """The episode id (the idempotency key; a v1 trajectory's id). The field keeps its v1 name."""
    outcome: str
    """'trained' or 'dropped'."""
    reason: str = ""
    step: int = 0
    policy_version: int = 0
    at: float = 0.0
    pid: int = 0
    sequences: list[int] = []
    """Stream sequences of the deliveries this line settles (one per distinct message of the episode)."""


class OutcomeLog:
    """Appends outcomes to a JSONL file (a no-op without a path)."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._encoder = msgspec.json.Encoder()

    def write(self, outcomes: Iterable[Outcome]) -> None:
        if self.path is None:
            return
        now, pid = time.time(), os.getpid()
        lines = []
        for o in outcomes:
            o.at, o.pid = o.at or now, o.pid or pid
            lines.append(self._encoder.encode(o) + b"\n")
        if lines:
            # One write per batch, unbuffered: a killed process leaves whole lines behind.
            with self.path.open("ab", buffering=0) as fh:
                fh.write(b"".join(lines))

    def restore_trained(self, ids: list[str], sequences: list[list[int]], *, step: int, policy_version: int) -> int:
        """Write the `trained` lines of a committed checkpoint's `ids` that the log lacks; how many were missing.

        A line cut short by a kill mid-write is closed with a newline first (and, being no whole
        line, does not count as present).
        """
        if self.path is None:
            return 0
        logged = read_outcomes(self.path, skip_torn=True) if self.path.exists() else []
        present = {o.trajectory_id for o in logged if o.outcome == TRAINED}
        seqs = sequences if len(sequences) == len(ids) else [[] for _ in ids]  # checkpoints before the field
        missing = [
            Outcome(trajectory_id=tid, outcome=TRAINED, step=step, policy_version=policy_version, sequences=s)
            for tid, s in zip(ids, seqs, strict=True)
            if tid not in present
        ]
        if missing and self.path.exists() and self.path.stat().st_size:
            with self.path.open("rb+", buffering=0) as fh:
                fh.seek(-1, 2)
                if fh.read(1) != b"\n":
                    fh.write(b"\n")
        self.write(missing)
        return len(missing)


def read_outcomes(path: str | Path, *, skip_torn: bool = False) -> list[Outcome]:
    """Every outcome in a log file, in order; `skip_torn`: pass over a line that is no whole
    outcome (one a kill cut short) instead of raising."""
    decoder = msgspec.json.Decoder(Outcome)
    out: list[Outcome] = []
    for line in Path(path).read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            out.append(decoder.decode(line))
        except msgspec.DecodeError:
            if not skip_torn:
                raise
    return out
