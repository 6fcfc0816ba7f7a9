"""Reading an SFT set: the learner's exported RL episodes as supervised warm-start rows.

Rejection-sampling fine-tuning: the learner's `[learner] sft_export_path` (services/learner
`sft_export.py`) appends every settled train episode whose reward reached its threshold, one
`ScoredEpisode` JSON line each. A warm-start from that file (`[warmstart] sft_from`, passed to
`sft_warmstart` as `rows`) trains on the policy's own verified episodes instead of the env's
reference answers or its scripted expert: exactly the tokens the policy sampled (loss mask 1),
laid out as its rollouts laid them out, through `episode_examples` as an expert's episodes are.

This is the one reader of the format; a torn last line (a learner killed mid-write) is skipped.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from slipstream.schemas import ScoredEpisode
from slipstream.supervised.expert import Example, episode_examples


class SftSetError(ValueError):
    """An SFT set that cannot warm-start this run; the message names the file and the problem."""


def read_sft_set(path: str | Path) -> list[ScoredEpisode]:
    """Every whole line of the file, decoded; a line that does not decode is an error unless it is the last."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SftSetError(f"{path}: cannot read the SFT set: {exc.strerror or exc}") from exc
    decoder = msgspec.json.Decoder(ScoredEpisode)
    lines = raw.split(b"\n")
    out: list[ScoredEpisode] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.append(decoder.decode(line))
        except msgspec.DecodeError as exc:
            if number == len(lines):  # no newline after it: a write cut short
                break
            raise SftSetError(f"{path}:{number}: not a ScoredEpisode line: {exc}") from exc
    return out


def sft_set_examples(path: str | Path, *, env: str, min_reward: float | None = None) -> list[Example]:
    """The training rows of the set's episodes of `env` (each trainable sample, its sampled tokens trained).

    `min_reward` filters further than the export did (None: every line). An empty result, or an
    episode of another env, is an SftSetError naming the file: a warm-start on nothing, or on
    another task's prompts, is never what a run meant.
    """
    episodes = read_sft_set(path)
    others = sorted({s.episode.env for s in episodes if s.episode.env != env})
    if others:
        raise SftSetError(f"{path}: episodes of {others}, but this run trains {env!r}")
    kept = [s for s in episodes if min_reward is None or s.reward >= min_reward]
    rows = [row for s in kept for row in episode_examples(s.episode)]
    if not rows:
        raise SftSetError(f"{path}: no training rows ({len(episodes)} episodes, {len(kept)} kept)")
    return rows
