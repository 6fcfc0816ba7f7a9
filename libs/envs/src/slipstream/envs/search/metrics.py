"""The search agent's metrics, as Context-1's report tabulates them (techniques.md §4.7).

Per episode (`episode_metrics`), from the task's metadata and the wire `Episode` (its tool log is
the full, unpruned record):

- `final_answer_found`: an output document holds the final answer;
- `precision`, `output_recall`, `f1`: of the output documents against the targets;
- `traj_recall`: targets seen at any point, pruned or not (search failures vs selection failures:
  compare with `output_recall`);
- `pruned` / `pruned_irrelevant`: chunks pruned, and of those, how many belong to no target
  (prune accuracy = irrelevant / pruned, pooled over episodes; None where nothing was pruned);
- `tool_calls`, `call_turns`, `turns`: calls, turns that made calls, model turns
  (tool calls per turn = calls / call turns, pooled; turns per episode as a mean and a median);
- the share of episodes that pruned at least one chunk (`prune_share`, pooled);
- `budget_refusals`: calls refused by the budget rules (aggregated: the total, and per episode);
- `parse_ok`: the final output was a well-formed `<docs>` list.

`aggregate` pools a list of them into named means, `<prefix>/<metric>` (metric names are paths).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

import msgspec

from slipstream.envs.search.reward import precision_recall
from slipstream.envs.search.tools import RETRIEVAL_TOOLS, doc_of, parse_output
from slipstream.schemas import Episode


class EpisodeMetrics(msgspec.Struct, frozen=True, kw_only=True):
    final_answer_found: bool
    precision: float
    output_recall: float
    f1: float
    traj_recall: float
    pruned: int
    pruned_irrelevant: int
    tool_calls: int
    call_turns: int
    turns: int
    budget_refusals: int
    parse_ok: bool


def _ids(value: str) -> list[str]:
    return [c for c in value.split(",") if c]


def episode_metrics(metadata: Mapping[str, str], episode: Episode, *, max_output_docs: int = 5) -> EpisodeMetrics:
    """One episode's metrics; `metadata` is its task's (targets, answer_docs)."""
    targets = set(metadata["targets"].split())
    answer_docs = set(metadata["answer_docs"].split())
    parsed = parse_output(episode.final_text, max_output_docs)
    output = parsed or []
    precision, recall = precision_recall(output, targets)
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    log = episode.tool_log
    seen = {
        doc_of(c)
        for ev in log
        if ev.status == "ok" and ev.name in RETRIEVAL_TOOLS
        for c in _ids(ev.info.get("chunks", ""))
    }
    pruned = [c for ev in log for c in _ids(ev.info.get("pruned", ""))]
    return EpisodeMetrics(
        final_answer_found=bool(set(output) & answer_docs),
        precision=precision,
        output_recall=recall,
        f1=f1,
        traj_recall=precision_recall(seen, targets)[1],
        pruned=len(pruned),
        pruned_irrelevant=sum(doc_of(c) not in targets for c in pruned),
        tool_calls=len(log),
        call_turns=len({(ev.sample_id, ev.turn) for ev in log}),
        turns=episode.counts.get("turns", 0),
        budget_refusals=sum(ev.info.get("kind") == "budget_refused" for ev in log),
        parse_ok=parsed is not None,
    )


def aggregate(metrics: Sequence[EpisodeMetrics], *, prefix: str = "search") -> dict[str, float]:
    """Means over episodes; prune accuracy and calls per turn pooled (ratios of sums).

    Prune accuracy is left out when nothing was pruned (no evidence either way)."""
    n = len(metrics)
    if n == 0:
        return {}

    def mean(values: Sequence[float]) -> float:
        return sum(values) / n

    out = {
        "final_answer_found": mean([float(m.final_answer_found) for m in metrics]),
        "output_recall": mean([m.output_recall for m in metrics]),
        "precision": mean([m.precision for m in metrics]),
        "f1": mean([m.f1 for m in metrics]),
        "traj_recall": mean([m.traj_recall for m in metrics]),
        "tool_calls_per_turn": sum(m.tool_calls for m in metrics) / max(1, sum(m.call_turns for m in metrics)),
        "turns_per_episode": mean([float(m.turns) for m in metrics]),
        "turns_median": float(statistics.median(m.turns for m in metrics)),
        "prune_share": mean([float(m.pruned > 0) for m in metrics]),
        "budget_refusals": float(sum(m.budget_refusals for m in metrics)),
        "budget_refusals_per_episode": mean([float(m.budget_refusals) for m in metrics]),
        "malformed_output": mean([float(not m.parse_ok) for m in metrics]),
        "episodes": float(n),
    }
    pruned = sum(m.pruned for m in metrics)
    if pruned:
        out["prune_accuracy"] = sum(m.pruned_irrelevant for m in metrics) / pruned
    return {f"{prefix}/{k}": v for k, v in out.items()}
