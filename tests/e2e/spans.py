"""Span records of a traced run, indexed for the trace test (tests/e2e/test_demo_run.py)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from slipstream.learner.outcomes import Outcome, read_outcomes

Span = dict[str, Any]


class Spans:
    """Span records indexed by id, parent and name."""

    def __init__(self, records: Iterable[Span]) -> None:
        self.all = list(records)
        self.by_id = {s["span_id"]: s for s in self.all}
        self.by_name: dict[str, list[Span]] = defaultdict(list)
        self.children: dict[str, list[Span]] = defaultdict(list)
        for s in self.all:
            self.by_name[s["name"]].append(s)
            if s["parent_span_id"]:
                self.children[s["parent_span_id"]].append(s)

    def ancestors(self, span: Span) -> list[Span]:
        """Parent, grandparent, ... as far as the files go (nearest first)."""
        out: list[Span] = []
        parent = span["parent_span_id"]
        while parent is not None and parent in self.by_id:
            out.append(self.by_id[parent])
            parent = out[-1]["parent_span_id"]
        return out

    def descendants(self, span: Span, name: str) -> list[Span]:
        found: list[Span] = []
        todo = [span]
        while todo:
            for child in self.children[todo.pop()["span_id"]]:
                if child["name"] == name:
                    found.append(child)
                todo.append(child)
        return found

    def nearest(self, span: Span, prefix: str) -> Span | None:
        """The closest ancestor whose name starts with `prefix`."""
        return next((a for a in self.ancestors(span) if a["name"].startswith(prefix)), None)


def outcomes(run_dir: Path) -> list[Outcome]:
    """The learner's outcomes log, read by the learner's own reader."""
    return read_outcomes(run_dir / "learner-outcomes.jsonl")


def trained_ids(run_dir: Path) -> dict[str, int]:
    """trajectory id -> step, for every trajectory the learner trained (its outcomes log)."""
    return {o.trajectory_id: o.step for o in outcomes(run_dir) if o.outcome == "trained"}


def trained_groups(run_dir: Path, group_size: int) -> tuple[int, int, dict[str, tuple[int, int]]]:
    """(groups trained, trajectories trained, groups that do not add up) from the learner's outcomes log.

    The learner trains a group whole, or less the members it dropped on their own (a member gone
    stale, malformed, ...: it still counts as an arrival, and the rest train against the survivors'
    baseline; learner/intake.py), so for every group with a trained member, trained + dropped
    members == group_size. The odd ones map to (trained, dropped). A group is a trajectory id less
    its last part (`<run>:<task>/<sampling>/<index>`)."""
    final: dict[str, str] = {}
    for o in outcomes(run_dir):
        if final.get(o.trajectory_id) != "trained":
            final[o.trajectory_id] = o.outcome
    members: dict[str, list[str]] = {}
    for tid, outcome in final.items():
        members.setdefault(tid.rsplit("/", 1)[0], []).append(outcome)
    trained = {g: outs.count("trained") for g, outs in members.items() if "trained" in outs}
    odd = {g: (n, len(members[g]) - n) for g, n in trained.items() if len(members[g]) != group_size}
    return len(trained), sum(trained.values()), odd
