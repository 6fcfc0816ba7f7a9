"""The SFT export: the learner's verified episodes above a reward threshold, as a supervised set.

Rejection-sampling fine-tuning (Kimi K2.5 §4.4.2): the episodes outcome-based RL produced, kept
when their reward reaches `[learner] sft_export_min_reward`, become supervised data for a later
warm-start (`slipstream train` with `[warmstart] sft_from`, read by `slipstream.supervised.sft_set`).
Written beside the outcome log and at the same moments, so a line means the learner settled it:

- trained episodes when the checkpoint covering their step commits (a step lost in a crash
  exports nothing, and a resumed learner does not export its restored ids again);
- members of groups dropped as `uniform_group`: a group every member of which is right is
  never trained on (no advantage signal), yet those are exactly the samples rejection sampling
  keeps, so they are exported too when they pass the threshold.

Held-out episodes never reach either path (the intake drops them on arrival). One JSON line per
episode: the `ScoredEpisode` wire record as msgspec encodes it (token ids and masks packed as
base64 bytes), so a reader rebuilds the exact training rows the policy sampled. Off unless
`[learner] sft_export_path` is set.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import msgspec

from slipstream.schemas import ScoredEpisode


class SftExport:
    """Appends scored episodes whose reward is at least `min_reward` to a JSONL file (a no-op without a path)."""

    def __init__(self, path: str | Path | None, min_reward: float) -> None:
        if not math.isfinite(min_reward):
            raise ValueError(f"sft_export_min_reward must be finite, got {min_reward}")
        self.path = Path(path) if path else None
        self.min_reward = min_reward
        self.exported = 0
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._encoder = msgspec.json.Encoder()

    def write(self, episodes: Iterable[ScoredEpisode]) -> int:
        """Export the train-split episodes at or above the threshold; returns how many were written."""
        if self.path is None:
            return 0
        lines = [
            self._encoder.encode(s) + b"\n"
            for s in episodes
            if s.reward >= self.min_reward and s.episode.split == "train" and not s.unscorable
        ]
        if lines:
            # One unbuffered write per batch, as the outcome log: a killed process leaves whole lines.
            with self.path.open("ab", buffering=0) as fh:
                fh.write(b"".join(lines))
            self.exported += len(lines)
        return len(lines)
