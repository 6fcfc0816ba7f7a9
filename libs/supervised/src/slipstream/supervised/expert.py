"""Examples from a scripted expert: its episodes played through the real harness, one training
example per trainable sample, drawn as a warm-start's steps reach them (warmstart.py trains on them).

`expert_examples` plays `env.expert` (scripted.py) on each distinct task once; the loss covers
exactly the tokens the expert "sampled" (loss mask 1), never the prompt or the tool results.
`summary` plays the episodes with context restarts (summary.py): given several configs, task i
is played under config i mod n.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeAlias

import msgspec

from slipstream.engine.interface import GenerationRequest, SamplingParams
from slipstream.engine.tokenizer import Tokenizer
from slipstream.envs.base import Environment, TaskSpec
from slipstream.harness.rollout import rollout_episodes
from slipstream.harness.summary import SummaryConfig
from slipstream.schemas import Episode
from slipstream.supervised.scripted import ScriptedEngine

# One training example: token ids and, per id, whether it is a trained target.
Example = tuple[list[int], list[bool]]
# Context modes the expert's episodes are played under (see the module docstring).
Summaries: TypeAlias = SummaryConfig | Sequence[SummaryConfig] | None


def _modes(summary: Summaries) -> list[SummaryConfig | None]:
    if summary is None or isinstance(summary, SummaryConfig):
        return [summary]
    if not summary:
        raise ValueError("summary: give a SummaryConfig, a non-empty list of them, or None")
    return list(summary)


def episode_examples(episode: Episode, *, frozen: int | None = 0) -> list[Example]:
    """(ids, trained) of each trainable sample: the sample's ids, True where its loss mask is 1.

    `frozen`: how many untrainable samples to add too, the first ones (0: none; None: all). An
    env's `warmstart_frozen_samples`: the swarm's sub-agents, frozen in RL, learn their search
    skill from the expert's sub-agent episodes here, capped by `warmstart_frozen_rows`."""
    out: list[Example] = []
    taken = 0
    for s in episode.samples:
        if not s.trainable:
            if frozen is not None and taken >= frozen:
                continue
            taken += 1
        out.append((s.ids(), [False] * s.prompt_len + [bool(m) for m in s.mask()]))
    return out


async def expert_episodes(
    env: Environment[msgspec.Struct],
    tokenizer: Tokenizer,
    tasks: list[TaskSpec],
    *,
    max_tokens: int = 1024,
    summary: Summaries = None,
    concurrency: int = 32,
    first_index: int = 0,
) -> list[Episode]:
    """One episode per task, played by `env.expert` through the harness (see scripted.py);
    task i under context mode (first_index + i) mod n of `summary`.

    At most `concurrency` episodes are in flight: an env whose tools run real processes (`code`'s
    sandboxes) cannot start thousands at once (6,400 concurrent expert episodes on 2 cores: every
    first tool call timed out after 15 s, an infra error, and the warm-start trained on the first
    call alone). Each episode is a function of its task, so the bound changes no episode."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    modes = _modes(summary)
    slots = asyncio.Semaphore(concurrency)

    def one(task: TaskSpec) -> ScriptedEngine:
        def reply(_: GenerationRequest, context: str) -> str:
            return env.expert(task, context)

        return ScriptedEngine(tokenizer, reply)

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    async def play(i: int, t: TaskSpec) -> Episode:
        mode = modes[(first_index + i) % len(modes)]
        async with slots:
            group = await rollout_episodes(
                one(t), tokenizer, env, t, group_size=1, params=params, group_id=t.task_id, summary=mode
            )
        return group[0]

    return list(await asyncio.gather(*(play(i, t) for i, t in enumerate(tasks))))


EXPERT_CHUNK = 256  # distinct tasks played at a time by `expert_examples` with a limit


def expert_examples(
    env: Environment[msgspec.Struct],
    tokenizer: Tokenizer,
    tasks: list[TaskSpec],
    summary: Summaries = None,
    *,
    limit: int | None = None,
) -> list[Example]:
    """Training examples from the expert's episodes, one per trainable sample, in task order.

    Each distinct task key is played once (the i-th distinct key under summary mode i mod n).
    `limit`: the caller uses only the first `limit` examples, so an env that keeps every expert
    episode (the default `curate_expert_episodes`) has its distinct keys played in order,
    `EXPERT_CHUNK` at a time, only until that many examples are in hand; the examples returned
    are the same prefix. An env whose episode gives several examples (the swarm: an orchestrator
    and ~5 sub-agents) had played 5x the episodes it trained on. A curating env's filter sees
    every episode at once, as before, so `limit` does not apply to it.
    """
    out: list[Example] = []
    for part in expert_example_chunks(env, tokenizer, tasks, summary, chunked=limit is not None):
        out.extend(part)
        if limit is not None and len(out) >= limit:
            break
    return out


def expert_example_chunks(
    env: Environment[msgspec.Struct],
    tokenizer: Tokenizer,
    tasks: list[TaskSpec],
    summary: Summaries = None,
    *,
    chunked: bool = True,
) -> Iterator[list[Example]]:
    """`expert_examples`, lazily: the examples of the next tasks in order, one list per chunk of
    `EXPERT_CHUNK` distinct keys played (`chunked`, an env that does not curate its expert's
    episodes), else one list of all. Joined, the lists are `expert_examples(...)` whole."""
    unique: dict[str, TaskSpec] = {}
    for t in tasks:
        unique.setdefault(t.metadata.get("key", t.task_id), t)
    keys = list(unique)
    frozen = env.warmstart_frozen_rows() if env.warmstart_frozen_samples else 0
    curated = type(env).curate_expert_episodes is not Environment.curate_expert_episodes
    by_key: dict[str, list[Example]] = {}
    pos = 0  # tasks[:pos] have been yielded
    chunk = EXPERT_CHUNK if chunked and not curated else len(keys)
    for start in range(0, len(keys), max(1, chunk)):
        part = [unique[k] for k in keys[start : start + chunk]]
        played = asyncio.run(expert_episodes(env, tokenizer, part, summary=summary, first_index=start))
        # The env may filter its teacher's episodes (e.g. Context-1's SFT rules); a dropped one adds nothing.
        keep = env.curate_expert_episodes(part, played)
        for t, e, k in zip(part, played, keep, strict=True):
            by_key[t.metadata.get("key", t.task_id)] = episode_examples(e, frozen=frozen) if k else []
        # Distinct keys come in order of first appearance: every task up to the next unplayed key is covered.
        out: list[Example] = []
        while pos < len(tasks) and (key := tasks[pos].metadata.get("key", tasks[pos].task_id)) in by_key:
            out.extend(by_key[key])
            pos += 1
        yield out


class _Rows:
    """Training rows drawn from `parts` only as the steps reach them: a warm-start that stops at
    its probe's target plays no expert episode it would not train on (a sandboxed `code` expert
    played 10,000 episodes up front for a 3,800-step cap). The rows are those of the joined list;
    `cycle`: that list repeated without end (epochs over a pool of tasks)."""

    def __init__(self, parts: Iterable[list[Example]], *, cycle: bool = False) -> None:
        self._parts = iter(parts)
        self._rows: list[Example] = []
        self._done = False
        self._cycle = cycle

    def take(self, start: int, stop: int) -> list[Example]:
        while not self._done and len(self._rows) < stop:
            part = next(self._parts, None)
            self._done = part is None
            self._rows.extend(part or [])
        if not self._cycle or not self._rows:
            return self._rows[start:stop]
        return [self._rows[i % len(self._rows)] for i in range(start, stop)]
