"""Context-1's SFT warm-up filter over expert episodes (techniques.md §4.5), as a pure function.

Rules, applied in this order to candidates (one per episode: its query, trajectory recall, output
recall, whether its output parsed, and its reward):

1. malformed output: dropped;
2. trajectory recall exceeding output recall by more than `gap` (explored well, concluded
   badly): dropped entirely;
3. output recall >= `high_recall`: one episode per query is kept (highest reward, then id);
4. trajectory recall > 0.5 and output recall > 0.4: kept in full;
5. zero output recall: negatives, one per query, at most `negative_share` (5 %) of the positives
   kept by rules 3, 4 and 6;
6. any other (lower, non-zero recall): kept with probability (output recall / 0.4)^`power`, a
   diminishing rate, drawn from a hash of (seed, episode id) so a filter run is reproducible.

The thresholds the report gives are the defaults; `high_recall`, `gap` and `power` are ours (not
disclosed).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import msgspec

from slipstream.envs.base import fixed_draw
from slipstream.envs.search.metrics import episode_metrics
from slipstream.schemas import Episode


class SftCandidate(msgspec.Struct, frozen=True, kw_only=True):
    episode_id: str
    query: str  # the task's canonical key: rollouts of one query share it
    traj_recall: float
    output_recall: float
    parse_ok: bool
    reward: float = 0.0


class SftFilterConfig(msgspec.Struct, frozen=True, kw_only=True):
    keep_traj: float = 0.5
    keep_output: float = 0.4
    high_recall: float = 0.8
    gap: float = 0.5
    negative_share: float = 0.05
    power: float = 2.0
    seed: int = 0


class SftSelection(msgspec.Struct, frozen=True):
    kept: list[str]  # episode ids, in candidate order
    counts: dict[str, int]  # by rule: kept_high, kept_full, kept_lower, kept_negative, dropped_*


def candidate_of(metadata: dict[str, str], episode: Episode, *, reward: float = 0.0) -> SftCandidate:
    """An episode as the filter sees it (recalls from the metrics; the query is the task key)."""
    m = episode_metrics(metadata, episode)
    return SftCandidate(
        episode_id=episode.episode_id,
        query=metadata["key"],
        traj_recall=m.traj_recall,
        output_recall=m.output_recall,
        parse_ok=m.parse_ok,
        reward=reward,
    )


def _draw(seed: int, episode_id: str) -> float:
    return fixed_draw(f"{seed}:{episode_id}")


def sft_filter(candidates: Sequence[SftCandidate], config: SftFilterConfig = SftFilterConfig()) -> SftSelection:
    """Which episodes to warm-start on, and how many each rule kept or dropped."""
    counts: Counter[str] = Counter()
    kept: set[str] = set()
    negatives: list[SftCandidate] = []
    best_high: dict[str, SftCandidate] = {}
    for c in candidates:
        if not c.parse_ok:
            counts["dropped_malformed"] += 1
        elif c.traj_recall - c.output_recall > config.gap:
            counts["dropped_gap"] += 1
        elif c.output_recall >= config.high_recall:
            other = best_high.get(c.query)
            if other is None or (c.reward, other.episode_id) > (other.reward, c.episode_id):
                best_high[c.query] = c
        elif c.traj_recall > config.keep_traj and c.output_recall > config.keep_output:
            kept.add(c.episode_id)
            counts["kept_full"] += 1
        elif c.output_recall == 0.0:
            negatives.append(c)
        elif _draw(config.seed, c.episode_id) < (c.output_recall / config.keep_output) ** config.power:
            kept.add(c.episode_id)
            counts["kept_lower"] += 1
        else:
            counts["dropped_lower"] += 1
    high = {c.episode_id for c in best_high.values()}
    kept |= high
    counts["kept_high"] = len(high)
    counts["dropped_duplicate_high"] = sum(
        1 for c in candidates if c.parse_ok and c.episode_id not in high and best_high.get(c.query) not in (None, c)
        and c.output_recall >= config.high_recall and c.traj_recall - c.output_recall <= config.gap
    )  # fmt: skip
    cap = math.floor(config.negative_share * len(kept))
    queries: set[str] = set()
    for c in negatives:
        if c.query in queries:
            counts["dropped_negative_duplicate"] += 1
        elif len(queries) >= cap:
            counts["dropped_negative_cap"] += 1
        else:
            queries.add(c.query)
            kept.add(c.episode_id)
            counts["kept_negative"] += 1
    order = [c.episode_id for c in candidates if c.episode_id in kept]
    return SftSelection(kept=order, counts={k: v for k, v in sorted(counts.items()) if v})
