"""The chaos suite's counts, from the run's own records: joins, not assertions.

Every figure comes from a record something in the run wrote: the trajectory tap's ids (every
`traj.raw.>` publish it saw), the learner's outcome log (one line per trajectory it settled), the
dead letters and what is left in the trajectory streams (read back from the run's JetStream
store after the run), the `weights.announce` log (the WEIGHTS stream) checked against the signed
manifests in the store, and the rollout workers' logs (each version a worker applied). The
functions here are pure so the unit tests can feed them hand-made records.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrajectoryJoin:
    """Published trajectory ids joined with what became of them."""

    published: int = 0
    """Distinct trajectory ids published on traj.raw.> (seen by the tap, or anywhere downstream)."""
    untracked_by_tap: int = 0
    """Ids found downstream that the tap never saw published (it was reconnecting, e.g. during a NATS restart)."""
    trained: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    dead_lettered: int = 0
    left: int = 0
    trained_twice: int = 0
    """Trajectory ids with more than one `trained` line in the learner's outcome log."""
    lost: int = 0
    """Published ids that were neither trained, dropped with a reason, dead-lettered nor left in a stream."""
    lost_ids: list[str] = field(default_factory=list)
    settled_but_left: list[str] = field(default_factory=list)
    """Ids the learner's outcome log settles that a stream still holds at the end: their acks never
    reached the server (or a second copy was published). Not lost, but the demo summary's stream
    balance counts them twice; listed so that an unbalanced summary can be traced."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "published": self.published,
            "untracked_by_tap": self.untracked_by_tap,
            "trained": self.trained,
            "dropped": dict(sorted(self.dropped.items())),
            "dead_lettered": self.dead_lettered,
            "left": self.left,
            "trained_twice": self.trained_twice,
            "lost": self.lost,
            "lost_ids": self.lost_ids[:20],
            "settled_but_left": len(self.settled_but_left),
            "settled_but_left_ids": self.settled_but_left[:20],
        }


def join_trajectories(
    published: Iterable[str],
    outcomes: Iterable[Mapping[str, Any]],
    dead_lettered: Iterable[str],
    left: Iterable[str],
) -> TrajectoryJoin:
    """Join the published ids with the learner's outcome lines, the dead letters and the streams' leftovers.

    An id counts once: `trained` if any line trained it or called it a `duplicate` (its id is in
    a committed checkpoint: trained by this learner or one before it), else dropped with its first
    reason; an id not settled by the learner counts as dead-lettered or left when it is there.
    `trained_twice` counts ids with two or more `trained` lines (two learners each committing a
    step with it); `lost` is what nothing accounts for.
    """
    tapped = set(published)
    dead, rest = set(dead_lettered), set(left)
    trained_lines: Counter[str] = Counter()
    final: dict[str, str] = {}
    for row in outcomes:
        tid = str(row["trajectory_id"])
        trained = row.get("outcome") == "trained"
        if trained:
            trained_lines[tid] += 1
        key = "trained" if trained or row.get("reason") == "duplicate" else str(row.get("reason") or "dropped")
        if tid not in final or (key == "trained" and final[tid] != "trained"):
            final[tid] = key
    everything = tapped | set(final) | dead | rest
    out = TrajectoryJoin(published=len(everything), untracked_by_tap=len(everything - tapped))
    dropped: Counter[str] = Counter()
    for key in final.values():
        if key == "trained":
            out.trained += 1
        else:
            dropped[key] += 1
    out.dropped = dict(dropped)
    unsettled = everything - set(final)
    out.dead_lettered = len(unsettled & dead)
    out.left = len((unsettled - dead) & rest)
    out.trained_twice = sum(1 for n in trained_lines.values() if n > 1)
    lost = sorted(tapped - set(final) - dead - rest)
    out.lost, out.lost_ids = len(lost), lost
    out.settled_but_left = sorted(set(final) & rest)
    return out


@dataclass(frozen=True)
class AnnounceRecord:
    """One message on weights.announce and whether the run's publisher sent it."""

    policy_version: int
    genuine: bool
    """Its manifest exists, is this version, is signed by the run's key, and carries the announce's token."""
    why: str = ""


def versions_announced_twice(records: Iterable[AnnounceRecord]) -> dict[int, int]:
    """Versions the publisher announced more than once (version -> genuine announces)."""
    counts = Counter(r.policy_version for r in records if r.genuine)
    return {v: n for v, n in sorted(counts.items()) if n > 1}


def corrupted_applied(corrupted: Mapping[int, float], applied: Iterable[tuple[int, float]]) -> list[int]:
    """Corrupted versions some worker applied after the corruption (version -> when it was corrupted).

    `applied`: (version, wall time) per "applied weights" line of the workers' logs. A version a
    worker applied before its shard was corrupted was sound when it was applied.
    """
    return sorted({v for v, at in applied if v in corrupted and at >= corrupted[v]})
