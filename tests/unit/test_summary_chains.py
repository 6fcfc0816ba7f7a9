"""Self-summarising chains through the real harness: links, restart contexts, credit, weights, thresholds.

A local multi-turn environment (`Facts`) shows one fact per turn and asks for the first one at
the end, so its context keeps growing; a scripted policy answers "next" until asked, writes a
summary holding the facts when the harness asks for one, and answers from its context at the end.
The harness (libs/harness summary.py) must cut the episode into links at the group's threshold,
without the environment knowing.
"""

from __future__ import annotations

import itertools
import random
import re
from typing import ClassVar

import msgspec
import pytest

from slipstream.engine import ByteTokenizer, GenerationRequest, SamplingParams
from slipstream.envs import EpisodeContext, Outcome
from slipstream.envs.base import Environment, Problem, Score, TaskSpec
from slipstream.harness import RecordingEngine, SummaryConfig, group_threshold, rollout_episodes, token_problems
from slipstream.harness.summary import DEFAULT_REQUEST, TRUNCATED, restart_text
from slipstream.rl.credit import episode_figures, sample_weights, token_advantages
from slipstream.schemas import decode, encode, unpack_ids, unpack_mask
from slipstream.supervised import ScriptedEngine

pytestmark = pytest.mark.unit

TOK = ByteTokenizer()
TURNS = 12


class _Options(msgspec.Struct, frozen=True):
    pass


class Facts(Environment[_Options]):
    """Twelve turns of facts, then: what was the first one?"""

    name: ClassVar[str] = "t-facts"
    Options: ClassVar[type[msgspec.Struct]] = _Options
    components: ClassVar[tuple[str, ...]] = ("correct",)

    def sample(self, rng: random.Random) -> Problem:
        first = "".join(rng.choice("abcdef") for _ in range(3))
        return Problem(key=first, prompt="remember the first fact.\n", reference=first)

    def fact(self, task: TaskSpec, k: int) -> str:
        return task.reference if k == 0 else f"x{k:02d}"

    async def run(self, ctx: EpisodeContext) -> Outcome:
        thread = ctx.open(ctx.task.prompt)
        for k in range(TURNS):
            await ctx.generate(thread, max_tokens=8, stop=["\n"])
            ctx.observe(thread, f"fact {k}: {self.fact(ctx.task, k)}\n")
        ctx.observe(thread, "first fact?\n")
        last = await ctx.generate(thread, max_tokens=8, stop=["\n"])
        return Outcome(final_text=last.text, finish_reason=last.finish_reason)

    def grade(self, task: TaskSpec, completion: str) -> Score:
        correct = completion.strip() == task.reference
        return Score.of({"correct": float(correct)}, correct=correct, parse_ok=True, reason="")


def policy(_: GenerationRequest, context: str) -> str:
    """Summarise the facts it can see; answer the first fact it can see; otherwise ask for more."""
    seen = re.findall(r"fact 0: (\w+)", context) or re.findall(r"\]\n(\w+) and more", context)
    first = seen[0] if seen else "?"
    if context.endswith("<summary>"):
        return f"{first} and more</summary>"
    if context.endswith("first fact?\n"):
        return first + "\n"
    return "next\n"


async def _play(config: SummaryConfig, group_id: str = "g-1", size: int = 2) -> tuple[list, RecordingEngine]:
    env = Facts()
    task = env.generate("train", 1, seed=3)[0]
    engine = RecordingEngine(ScriptedEngine(TOK, policy, max_seq_len=4096))
    params = SamplingParams(temperature=1.0, max_tokens=64)
    episodes = await rollout_episodes(
        engine, TOK, env, task, group_size=size, params=params, group_id=group_id, summary=config
    )
    return episodes, engine


# A threshold that the facts pass three times in 12 turns; fixed so the test knows where links end.
THREE = SummaryConfig(enabled=True, min_tokens=140, max_tokens=140, summary_tokens=48)


async def test_an_episode_with_three_summaries_is_four_linked_samples() -> None:
    episodes, engine = await _play(THREE)
    for episode in episodes:
        assert token_problems(episode, engine.calls_of(episode), TOK) == []  # ids made once, never re-encoded
        samples = episode.samples
        assert len(samples) == 4 and episode.counts["summaries"] == 3
        assert [s.edit for s in samples] == ["", "summary", "summary", "summary"]
        assert [s.branch_of for s in samples[1:]] == [s.sample_id for s in samples[:-1]]
        assert [s.finish_reason for s in samples[:-1]] == ["summary"] * 3
        task_prompt = unpack_ids(samples[0].token_ids)[: samples[0].prompt_len]
        for k, link in enumerate(samples[1:], start=1):
            ids = unpack_ids(link.token_ids)
            # The restart keeps the task prompt verbatim (branch_pos covers it) and holds the summary and state.
            assert ids[: len(task_prompt)] == task_prompt and link.branch_pos >= len(task_prompt)
            restart = TOK.decode(ids[len(task_prompt) : link.prompt_len])
            state = restart_text(f"{episode.reference} and more", k)
            assert restart.startswith(state) and f"[Summaries so far: {k}]" in state
            # ... then what the policy had not answered yet (the last fact shown), verbatim.
            assert re.fullmatch(r"fact \d+: x\d\d\n", restart[len(state) :]), restart
        # Each summarised link ended with the request (an observation) and the summary (sampled).
        for link in samples[:-1]:
            roles = [t.role for t in link.turns]
            assert roles[-2:] == ["summary_request", "policy"] and link.turns[-2].text == DEFAULT_REQUEST
        # The fact needed at the end survived three restarts through the summaries alone.
        assert episode.final_text.strip() == episode.reference


async def test_whatever_thresholds_cut_the_chain_the_pending_question_survives_the_restart() -> None:
    # Some of these thresholds fall right before the final question: the restart must carry it.
    cuts = set()
    for threshold in range(100, 220, 6):
        config = SummaryConfig(enabled=True, min_tokens=threshold, max_tokens=threshold, summary_tokens=48)
        episodes, _ = await _play(config, size=1)
        cuts.add(len(episodes[0].samples))
        assert episodes[0].final_text.strip() == episodes[0].reference, f"threshold {threshold}"
    assert len(cuts) >= 3  # the sweep really cut the chain in different places


async def test_the_outcome_advantage_reaches_every_sampled_token_of_every_link_summaries_included() -> None:
    episodes, _ = await _play(THREE)
    episode = decode(encode(episodes[0]), type(episodes[0]))  # as the learner receives it
    advantages = token_advantages(episode, 0.75)
    summary_tokens = 0
    for sample, per_token in zip(episode.samples, advantages, strict=True):
        mask = unpack_mask(sample.loss_mask)
        assert len(per_token) == len(mask)
        assert all(a == (0.75 if m else 0.0) for a, m in zip(per_token, mask, strict=True))
        for turn in sample.turns:
            if turn.role == "policy" and turn.text.endswith("</summary>"):
                span = range(turn.start - sample.prompt_len, turn.end - sample.prompt_len)
                assert all(per_token[i] == 0.75 for i in span)
                summary_tokens += len(span)
    assert summary_tokens > 0


async def test_loss_weights_as_documented() -> None:
    episodes, _ = await _play(THREE)
    episode = episodes[0]
    # "token" (default): each link weight 1, so every sampled token trains exactly once however many links.
    assert sample_weights(episode, "token") == {s.sample_id: 1.0 for s in episode.samples}
    # "episode": the links of one (episode, agent) share weight 1.
    assert sample_weights(episode, "episode") == {s.sample_id: 0.25 for s in episode.samples}


async def test_the_threshold_is_drawn_once_per_group() -> None:
    config = SummaryConfig(enabled=True, min_tokens=90, max_tokens=200, summary_tokens=48)
    thresholds = {group_threshold(config, f"task-{i}/group") for i in range(50)}
    assert min(thresholds) >= 90 and max(thresholds) <= 200 and len(thresholds) > 10  # spread over the range
    episodes, _ = await _play(config, group_id="task-7/group", size=3)
    threshold = group_threshold(config, "task-7/group")
    for episode in episodes:
        for link in episode.samples[:-1]:
            request = link.turns[-2]
            # The link was cut at the first turn that started at or past the group's threshold.
            assert request.start >= threshold
            before = [t for t in link.turns if t.role == "policy" and t.end <= request.start][-1]
            assert before.start < threshold
    assert len({len(e.samples) for e in episodes}) == 1


async def test_disabled_or_absent_summaries_leave_one_growing_sample() -> None:
    for config in (None, SummaryConfig(enabled=False)):
        episodes, _ = await _play(config)  # type: ignore[arg-type]
        assert [len(e.samples) for e in episodes] == [1, 1]
        assert "summaries" not in episodes[0].counts


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="min_tokens <= max_tokens"):
        SummaryConfig(min_tokens=300, max_tokens=200)
    with pytest.raises(ValueError, match="summary_tokens and max_summaries"):
        SummaryConfig(summary_tokens=0)


async def test_the_learners_episode_figures_count_summaries_and_context_tokens() -> None:
    episodes, _ = await _play(THREE)
    figures = episode_figures(episodes)
    assert figures["summaries_per_episode"] == 3.0 and figures["samples_per_episode"] == 4.0
    assert figures["tokens_per_episode"] == sum(len(s.ids()) for s in episodes[0].samples)
    # Every link is shorter than the whole conversation would have been without restarts.
    assert all(len(s.ids()) < THREE.max_tokens + THREE.summary_tokens + 200 for s in episodes[0].samples)


# -- the truncation baseline and the run-file wiring ------------------------------------------------

TRUNCATE = SummaryConfig(enabled=True, mode="truncate", min_tokens=140, max_tokens=140, summary_tokens=20)


async def test_truncation_restarts_from_the_task_and_the_last_tokens_with_no_summary() -> None:
    episodes, engine = await _play(TRUNCATE)
    for episode in episodes:
        assert token_problems(episode, engine.calls_of(episode), TOK) == []
        samples = episode.samples
        assert len(samples) > 1 and episode.counts["truncations"] == len(samples) - 1
        assert "summaries" not in episode.counts
        assert all(s.edit == "truncate" for s in samples[1:])
        assert [s.finish_reason for s in samples[:-1]] == ["truncate"] * (len(samples) - 1)
        task_prompt = unpack_ids(samples[0].token_ids)[: samples[0].prompt_len]
        for parent, link in itertools.pairwise(samples):
            ids, parent_ids = unpack_ids(link.token_ids), unpack_ids(parent.token_ids)
            assert ids[: len(task_prompt)] == task_prompt
            marker = TOK.encode(TRUNCATED)
            assert ids[len(task_prompt) : len(task_prompt) + len(marker)] == marker
            tail = ids[len(task_prompt) + len(marker) : link.prompt_len]
            # The parent's last tokens, verbatim: summary_tokens of them, or more to keep the pending line whole.
            assert tail == parent_ids[len(parent_ids) - len(tail) :] and len(tail) >= TRUNCATE.summary_tokens
            pending = [t for t in parent.turns if t.role == "observation"][-1]
            assert len(tail) >= pending.end - pending.start
            # Nothing was asked of the policy and nothing sampled for the restart.
            assert all(t.role != "summary_request" for t in parent.turns)
        # The first fact was cut away with the early turns: the policy (which answers what it sees) cannot recall it.
        assert episode.final_text.strip() != episode.reference


async def test_truncation_and_summaries_keep_the_same_budget_across_a_restart() -> None:
    budget = dict(min_tokens=140, max_tokens=140, summary_tokens=20)
    summarised, _ = await _play(SummaryConfig(enabled=True, **budget), size=1)
    truncated, _ = await _play(SummaryConfig(enabled=True, mode="truncate", **budget), size=1)
    # Both restart at the group's threshold: every link but the last ends at or just past 140 tokens.
    for episode in (summarised[0], truncated[0]):
        for link in episode.samples[:-1]:
            cut = link.turns[-2].start if episode is summarised[0] else len(link.ids())
            assert 140 <= cut < 140 + 20
    # And the summary arm remembers what the truncation arm lost.
    assert summarised[0].final_text.strip() == summarised[0].reference
    assert truncated[0].final_text.strip() != truncated[0].reference


async def test_a_restart_template_carries_the_summary_and_the_count() -> None:
    template = "<s>{summary}</s>#{n}\n"
    episodes, _ = await _play(SummaryConfig(enabled=True, min_tokens=140, max_tokens=140, restart_template=template))
    link = episodes[0].samples[1]
    task_len = episodes[0].samples[0].prompt_len
    restart = TOK.decode(unpack_ids(link.token_ids)[task_len : link.prompt_len])
    assert restart.startswith(f"<s>{episodes[0].reference} and more</s>#1\n")


def test_mode_and_template_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="mode must be one of summary, truncate"):
        SummaryConfig(mode="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"restart_template must hold \{summary\} and \{n\}"):
        SummaryConfig(restart_template="no summary here")


async def test_the_rollout_workers_sampler_plays_its_summary_section() -> None:
    from slipstream.rollout_worker.config import RolloutWorkerConfig
    from slipstream.rollout_worker.sampler import Sampler
    from slipstream.runtime.config import resolve

    env = Facts()
    task = env.generate("train", 1, seed=3)[0].to_task(run_id="r", group_size=2)
    environ = {
        "SLIPSTREAM_SUMMARY__ENABLED": "true",
        "SLIPSTREAM_SUMMARY__MIN_TOKENS": "140",
        "SLIPSTREAM_SUMMARY__MAX_TOKENS": "140",
        "SLIPSTREAM_SUMMARY__SUMMARY_TOKENS": "48",
        "SLIPSTREAM_WORKER__MAX_TOKENS": "64",
    }
    for env_vars, links in ((environ, 4), ({}, 1)):
        cfg = resolve(RolloutWorkerConfig, environ=env_vars)
        engine = ScriptedEngine(TOK, policy, max_seq_len=4096)
        # As the service builds it: the [summary] section, enabled or not.
        sampler = Sampler(engine, TOK, cfg.worker, worker_id="w", run_id="r", summary=cfg.summary)
        sampler._envs[env.name] = env  # a test env the registry does not hold
        episodes = await sampler.sample(task)
        assert [len(e.samples) for e in episodes] == [links, links]
