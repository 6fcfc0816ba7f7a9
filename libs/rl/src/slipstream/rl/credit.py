"""Credit assignment for episodes: which tokens get which advantage, and with what weight.

An episode (`slipstream.schemas.Episode`) is one attempt at a task by one or more agents, made of
samples. The rules, all pure functions over the wire record:

1. **One advantage per (group, agent).** Every trainable agent of an episode earns the episode's
   reward. Within a group (one sampling of a task: `group_id`), each agent's rewards across the
   group's episodes form that agent's baseline: A = R − mean(R over the group's episodes in which
   the agent has a trainable sample) (`group_advantages`: Dr. GRPO, std off by default). The key
   is the sample's `agent_id`, not its `role`: a summary the policy writes (`role="summary"`) is
   the policy's own work and shares its advantage, as Composer 2 credits the final reward to every
   token of a summary chain; a second trainable agent (a planner next to an executor) gets its
   own baseline, as rLLM groups by `{task}:{agent}`.
2. **The advantage reaches exactly the sampled tokens.** Every mask = 1 token of every trainable
   sample of that agent gets the advantage; observation tokens (mask 0) get nothing, and samples
   of frozen agents (`trainable=False`, e.g. sub-agents on a pinned version) are skipped entirely
   (`token_advantages`).
3. **Cutting an episode into N samples does not make it count N times.** The weighting is
   chosen by `SampleWeighting`:

   - `"token"` (default): every sample has weight 1 (times the producer's `Sample.loss_weight`).
     Slipstream's losses sum per-token terms over the batch and divide by a constant (or by the
     batch's trained-token count) — never by each row's own length — so a sampled token's
     gradient does not depend on which sample it sits in. An episode cut into N samples
     therefore contributes exactly what the same tokens would uncut: the number of cuts (prunes,
     summaries) is not an implicit weight at all. A prompt re-shown after an edit is prompt
     (mask 0 by construction), so no token is trained twice. Dividing by N here would do harm: an
     episode that summarised four times would count a quarter as much per token, making the
     summary count a hidden optimisation target (verl #7580, anchors §12-13).
   - `"episode"`: each of an agent's N trainable samples in an episode gets 1/N, so the
     sample weights of an (episode, agent) sum to 1 (verl's session-equal weighting). Use it
     with a loss that averages within each row; with Slipstream's token-sum losses it
     down-weights long chains.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from slipstream.rl.advantages import group_advantages
from slipstream.rl.batch import TrainItem
from slipstream.schemas.episode import Episode, Sample, ScoredEpisode

SampleWeighting = Literal["token", "episode"]
SAMPLE_WEIGHTINGS: tuple[SampleWeighting, ...] = ("token", "episode")


def trainable_agents(episode: Episode) -> list[str]:
    """Agent ids with at least one trainable sample, in first-appearance order."""
    seen: list[str] = []
    for s in episode.samples:
        if s.trainable and s.agent_id not in seen:
            seen.append(s.agent_id)
    return seen


def agent_advantages(group: Sequence[ScoredEpisode], *, normalize_std: bool = False) -> list[dict[str, float]]:
    """Per episode of one group: {agent_id: advantage} for each of its trainable agents.

    An agent's baseline is the mean reward over the group's episodes in which that agent has a
    trainable sample (rule 1 of the module docstring). Episodes are stubs-free: load bodies first.
    """
    out: list[dict[str, float]] = [{} for _ in group]
    by_agent: dict[str, list[int]] = {}
    for i, scored in enumerate(group):
        if scored.episode.is_stub():
            raise ValueError(f"episode {scored.episode.episode_id!r} is a by-reference stub; load its body first")
        for agent in trainable_agents(scored.episode):
            by_agent.setdefault(agent, []).append(i)
    for agent, members in by_agent.items():
        adv = group_advantages([group[i].reward for i in members], normalize_std=normalize_std).tolist()
        for i, a in zip(members, adv, strict=True):
            out[i][agent] = float(a)
    return out


def token_advantages(episode: Episode, advantage: float | Mapping[str, float]) -> list[list[float]]:
    """Per sample (episode order), per token after its prompt: the advantage that token trains with.

    `advantage` is one number for every trainable agent, or {agent_id: advantage}. A mask = 1
    token of a trainable sample gets its agent's advantage; every other token (observations,
    every token of a frozen sample) gets 0.0. An agent missing from the mapping is an error.
    """
    out: list[list[float]] = []
    for s in episode.samples:
        mask = s.mask()
        if not s.trainable:
            out.append([0.0] * len(mask))
            continue
        if isinstance(advantage, Mapping):
            if s.agent_id not in advantage:
                raise KeyError(f"no advantage for agent {s.agent_id!r} of sample {s.sample_id!r}")
            a = float(advantage[s.agent_id])
        else:
            a = float(advantage)
        out.append([a if m else 0.0 for m in mask])
    return out


def sample_weights(episode: Episode, weighting: SampleWeighting = "token") -> dict[str, float]:
    """{sample_id: weight} for every trainable sample (frozen samples are absent); see the docstring.

    The weight multiplies the producer's `Sample.loss_weight`.
    """
    if weighting not in SAMPLE_WEIGHTINGS:
        raise ValueError(f"unknown sample weighting {weighting!r}; valid: {', '.join(SAMPLE_WEIGHTINGS)}")
    counts: dict[str, int] = {}
    for s in episode.samples:
        if s.trainable:
            counts[s.agent_id] = counts.get(s.agent_id, 0) + 1
    out: dict[str, float] = {}
    for s in episode.samples:
        if not s.trainable:
            continue
        if not math.isfinite(s.loss_weight) or s.loss_weight < 0:
            raise ValueError(f"sample {s.sample_id!r}: loss_weight must be finite and >= 0, got {s.loss_weight}")
        share = 1.0 if weighting == "token" else 1.0 / counts[s.agent_id]
        out[s.sample_id] = s.loss_weight * share
    return out


def turn_indices(sample: Sample, first_turn: int = 0) -> tuple[list[int], int]:
    """Per token after the prompt: the index of the policy turn that sampled it, −1 elsewhere.

    Turns are counted across the episode (pass the running count as `first_turn`); a turn is a
    maximal run of mask = 1 tokens, or a `Turn(role="policy")` span when the sample lists turns.
    Returns (indices, the next turn number).
    """
    mask = sample.mask()
    idx = [-1] * len(mask)
    turn = first_turn
    spans = [(t.start, t.end) for t in sample.turns if t.role == "policy"]
    if spans:
        for start, end in spans:
            for pos in range(max(start, sample.prompt_len), end):
                k = pos - sample.prompt_len
                if k < len(mask) and mask[k]:
                    idx[k] = turn
            turn += 1
        return idx, turn
    prev = 0
    for k, m in enumerate(mask):
        if m and not prev:
            turn += 1
        if m:
            idx[k] = turn - 1
        prev = m
    return idx, turn


@dataclass(frozen=True)
class EpisodeRows:
    """The training rows of one episode and where they came from."""

    episode_id: str
    items: list[TrainItem]
    sample_ids: list[str]


def episode_rows(
    episode: Episode, advantages: Mapping[str, float], weighting: SampleWeighting = "token"
) -> EpisodeRows:
    """One TrainItem per trainable sample with at least one sampled token (frozen ones skipped).

    Turn indices count the trainable samples' policy turns only, so nothing a frozen sample holds
    (its length, its turns) reaches a row.
    """
    weights = sample_weights(episode, weighting)
    items: list[TrainItem] = []
    ids: list[str] = []
    next_turn = 0
    for s in episode.samples:
        if not s.trainable:
            continue  # a frozen agent's turns are not the policy's: they neither train nor renumber its turns
        turns, next_turn = turn_indices(s, next_turn)
        if s.n_sampled() == 0:
            continue
        if s.agent_id not in advantages:
            raise KeyError(f"no advantage for agent {s.agent_id!r} of sample {s.sample_id!r}")
        items.append(
            TrainItem(
                token_ids=s.ids(),
                prompt_len=s.prompt_len,
                behaviour_logprobs=s.behaviour_logprobs(),
                loss_mask=s.mask(),
                advantage=float(advantages[s.agent_id]),
                loss_weight=weights[s.sample_id],
                turn_index=turns,
                routes=s.routes,
                routes_per_token=s.routes_per_token,
            )
        )
        ids.append(s.sample_id)
    return EpisodeRows(episode_id=episode.episode_id, items=items, sample_ids=ids)


def group_rows(
    group: Sequence[ScoredEpisode], *, normalize_std: bool = False, weighting: SampleWeighting = "token"
) -> list[EpisodeRows]:
    """Training rows for every episode of one group, with (group, agent) advantages."""
    advs = agent_advantages(group, normalize_std=normalize_std)
    return [episode_rows(s.episode, a, weighting) for s, a in zip(group, advs, strict=True)]


def episode_figures(episodes: Sequence[Episode]) -> dict[str, float]:
    """Per-step shape of the episodes trained on: turns, tool calls, invalid calls, samples.

    - turns_per_episode: mean `counts["turns"]` (else the policy turns found in the samples);
    - tool_calls_per_turn: Σ tool calls / Σ turns (`counts["tool_calls"]`, else the tool log);
    - invalid_call_rate: Σ invalid tool calls / Σ tool calls (0 when no call was made);
    - samples_per_episode: mean number of samples (frozen ones included);
    - summaries_per_episode: mean `counts["summaries"]` (self-summary restarts);
    - tokens_per_episode: mean tokens over all samples, prompts included (what the contexts held).
    """
    if not episodes:
        return {}
    turns = calls = invalid = samples = summaries = tokens = 0
    for ep in episodes:
        summaries += ep.counts.get("summaries", 0)
        tokens += sum(len(s.ids()) for s in ep.samples)
        n_turns = ep.counts.get("turns")
        if n_turns is None:
            n_turns = 0
            for s in ep.samples:
                n_turns = turn_indices(s, n_turns)[1]
        turns += n_turns
        calls += ep.counts.get("tool_calls", len(ep.tool_log))
        invalid += ep.counts.get("invalid_tool_call", sum(1 for e in ep.tool_log if e.status == "invalid_tool_call"))
        samples += ep.n_samples()
    n = len(episodes)
    return {
        "turns_per_episode": turns / n,
        "tool_calls_per_turn": calls / turns if turns else 0.0,
        "invalid_call_rate": invalid / calls if calls else 0.0,
        "samples_per_episode": samples / n,
        "summaries_per_episode": summaries / n,
        "tokens_per_episode": tokens / n,
    }


def episode_means(scored: Sequence[ScoredEpisode], counts: Sequence[str]) -> dict[str, float]:
    """Per-step means over the episodes trained on: the named `counts` and every score component.

    A count is left out when no episode has it (an env that does not keep it); where some have it,
    the others count 0 (a count is only recorded once its event happened, e.g. `subagents`). Every
    component named on any score appears as "component.<name>", 0 for a score without it. Used for
    the swarm's curves (critical vs total steps, sub-agents per episode) on `LearnerStep`.
    """
    if not scored:
        return {}
    n = len(scored)
    out: dict[str, float] = {}
    for name in counts:
        found = [s.episode.counts[name] for s in scored if name in s.episode.counts]
        if found:
            out[name] = sum(found) / n
    names = sorted({c for s in scored for c in s.components})
    for name in names:
        out[f"component.{name}"] = sum(s.components.get(name, 0.0) for s in scored) / n
    return out
