"""`search`: Context-1's retrieval sub-agent harness as a registered environment.

The model gets a question and four tools (tools.py) and must end with a ranked list of document
ids, `<docs>w0007 w0008</docs>`; it never answers the question itself. One turn is one line
(generation stops at "\\n"), holding tool calls in the tag protocol of libs/toolcalls, possibly
several (parallel calls); a turn without a call is the final output.

The harness rules (techniques.md §4.2):
- seen-chunk exclusion: every chunk id a search, grep or read has returned is passed to later
  searches and greps as the hidden `exclude` argument (reads exclude only chunks still in view, so
  a pruned chunk can be read again); the model's schemas do not have it;
- a token budget (`budget_tokens`: 2,048 by default for the tiny byte-level model, 32,768 for a
  real one) over the sample the model continues; after every turn the observation ends with
  `[Token usage: X/Y]` (X counted after the turn's results were appended);
- past half the budget, in training rollouts only (`soft_message`; the episode's purpose,
  `EpisodeContext.purpose`, not the task's split: a train-split evaluation never sees it), a
  suggestion to prune or conclude follows the usage line;
- past `hard_cutoff` (a fraction in [0.5, 1]) every call but prune_chunks is refused with an
  error telling the model to prune or conclude (counted: `budget_refusals`);
- results are cut to `search_tokens` per call and to what the budget leaves after `reserve_tokens`
  (kept free for the model's next response, which may be at most that long);
- prune_chunks is a context edit: a new sample whose view has `[pruned: <id>]` for each pruned
  chunk (view.py); the tool log keeps every result unpruned (events whose chunks were all pruned
  are marked `hidden`), and the reward reads that log.

The reward is reward.py's, from the tool log and the final output, with F_beta's beta for the
policy version that sampled the episode (`SearchOptions.beta_at`: 4 annealed to 2 over
`beta_anneal_versions` learner steps when the run sets it); the expert is expert.py's.
"""

from __future__ import annotations

import functools
import math
import random
from typing import Any, ClassVar

import msgspec

from slipstream.envs.base import SPLITS, Environment, Problem, Score, Split, TaskSpec, fixed_draw
from slipstream.envs.context import EpisodeContext, Outcome, Purpose
from slipstream.envs.registry import register
from slipstream.envs.search import expert as expert_policy
from slipstream.envs.search import reward as rw
from slipstream.envs.search.curation import candidate_of, sft_filter
from slipstream.envs.search.generator import (
    GeneratedCorpus,
    GeneratorOptions,
    SearchTask,
    curriculum_weights,
    generate_corpus,
)
from slipstream.envs.search.options import SearchOptions
from slipstream.envs.search.tools import (
    backend_tools,
    build_backend,
    doc_of,
    model_tools,
    parse_output,
)
from slipstream.envs.search.turn import TurnRunner
from slipstream.envs.search.view import SOFT_MESSAGE, View, usage_line
from slipstream.retrieval.types import SearchBackend
from slipstream.schemas import Episode
from slipstream.toolcalls import LocalTransport, renderer_for


@functools.lru_cache(maxsize=8)
def _corpus(options: GeneratorOptions) -> GeneratedCorpus:
    return generate_corpus(options)


SYSTEM_PROMPT = (
    "You are a retrieval subagent: find the documents that answer the question; do NOT answer it. "
    "Break the question into its key concepts and plan distinct, non-overlapping searches; call "
    "several tools in one turn when they are independent. Each tool call is one "
    '<tool>{"name": ..., "args": {...}}</tool> on a single line. After each round, reflect on what is '
    "known, what to search next, what to prune and whether you have enough. Watch the token usage "
    "line and prune chunks you do not need before the budget runs out. End with one line "
    "<docs>doc ids, most relevant first</docs>."
)


def prompt_of(task: SearchTask, *, tools_line: bool = True) -> str:
    return question_prompt(task.question, tools_line=tools_line)


def question_prompt(question_text: str, *, tools_line: bool = True) -> str:
    """The task prompt for a question (also what a swarm sub-agent is shown for its assignment)."""
    question = f"Find the documents that answer: {question_text}\n"
    if not tools_line:
        return question
    return (
        question + "Tools: search_corpus(query) grep_corpus(pattern) read_document(doc_id) prune_chunks(chunk_ids). "
        "Do not answer; end with <docs>ids, best first</docs>.\n"
    )


@register("search")
class Search(Environment[SearchOptions]):
    """Find the documents that answer a multi-hop question, within a token budget, pruning as it goes."""

    version: ClassVar[str] = "1"
    Options: ClassVar[type[msgspec.Struct]] = SearchOptions
    components: ClassVar[tuple[str, ...]] = rw.COMPONENTS
    warmstart_from_expert: ClassVar[bool] = True
    max_turns: ClassVar[int] = 1024  # the option `max_turns` is the real bound

    def __init__(self, options: SearchOptions | None = None) -> None:
        super().__init__(options)
        self.renderer = renderer_for("tags")
        self.model_registry = model_tools()
        self._backend: SearchBackend | None = None
        self.registry = backend_tools(self.backend)

    @property
    def max_completion_chars(self) -> int:
        return self.options.reserve_tokens

    @property
    def corpus(self) -> GeneratedCorpus:
        return _corpus(self.options.generator())

    def count_tokens(self, text: str) -> int:
        """The env's token estimate for backend budgets: UTF-8 bytes / `bytes_per_token`."""
        return math.ceil(len(text.encode()) / self.options.bytes_per_token)

    def backend(self) -> SearchBackend:
        """The in-process backend over this corpus, built on first use."""
        if self._backend is None:
            self._backend = build_backend(self.options.backend, self.corpus.documents, self.count_tokens)
        return self._backend

    # -- tasks ----------------------------------------------------------------------------------

    def split_of(self, key: str) -> Split:
        return "heldout" if key.partition("/")[0] == self.options.heldout_domain else "train"

    def sample(self, rng: random.Random) -> Problem:
        t = rng.choice(self.corpus.tasks)
        return Problem(
            key=t.key, prompt=prompt_of(t, tools_line=self.options.tools_line), reference=" ".join(t.targets)
        )

    def generate(self, split: Split, n: int, seed: int) -> list[TaskSpec]:
        """`n` tasks of `split`, hop counts drawn from the curriculum phase's mix (with replacement)."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        pool: dict[int, list[SearchTask]] = {}
        for t in self.corpus.tasks:
            if self.split_of(t.key) == split:
                pool.setdefault(t.hops, []).append(t)
        if not pool:
            raise ValueError(f"search: the corpus (options {self.options}) has no {split} tasks")
        mix = curriculum_weights(self.options.curriculum_phase, self.options.max_hops)
        hops = sorted(pool)
        weights = [mix[h - 1] for h in hops]
        rng = random.Random(f"{self.name}|{split}|{seed}")
        out = []
        for i in range(n):
            t = rng.choice(pool[rng.choices(hops, weights)[0]])
            out.append(self.task_spec(t, split=split, seed=seed, index=i))
        return out

    def task_spec(self, t: SearchTask, *, split: Split, seed: int, index: int) -> TaskSpec:
        return TaskSpec(
            task_id=f"{self.name}-{split}-{seed}-{index}",
            env=self.name,
            prompt=prompt_of(t, tools_line=self.options.tools_line),
            reference=" ".join(t.targets),
            seed=seed,
            split=split,
            metadata={
                "key": t.key,
                "domain": t.domain,
                "hops": str(t.hops),
                "question": t.question,
                "answer": t.answer,
                "targets": " ".join(t.targets),
                "answer_docs": " ".join(t.answer_docs),
                "queries": "|".join(t.queries),
            },
        )

    def chat_messages(self, task: TaskSpec, prompt: str) -> list[dict[str, str]]:
        """For chat models: Context-1's system-prompt essentials, then the task."""
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]

    def sft_example(self, task: TaskSpec) -> str:
        return f"<docs>{task.reference}</docs>\n"

    def expert(self, task: TaskSpec, context: str) -> str:
        return expert_policy.next_turn(task, context, self.options)

    def curate_expert_episodes(self, tasks: list[TaskSpec], episodes: list[Episode]) -> list[bool]:
        """Context-1's SFT filter (curation.py) over the expert's episodes."""
        cands = [
            candidate_of(t.metadata, e, reward=self.score(t, e).reward) for t, e in zip(tasks, episodes, strict=True)
        ]
        kept = set(sft_filter(cands).kept)
        return [e.episode_id in kept for e in episodes]

    def eval_metrics(self, tasks: list[TaskSpec], episodes: list[Episode]) -> dict[str, float]:
        """Context-1's metrics (metrics.py) pooled over the episodes, without the `search/` prefix."""
        from slipstream.envs.search.metrics import aggregate, episode_metrics

        rows = [
            episode_metrics(t.metadata, e, max_output_docs=self.options.max_output_docs)
            for t, e in zip(tasks, episodes, strict=True)
        ]
        return {k.partition("/")[2]: v for k, v in aggregate(rows).items()}

    # -- the episode ------------------------------------------------------------------------------

    def training(self, purpose: Purpose, task_id: str = "") -> bool:
        """Whether the soft suggestion is shown to an episode played for `purpose`: by default
        (`soft_message` "train") in training rollouts and teacher episodes, never in evaluations,
        whichever split the task is from; with `soft_message_share` < 1 only in that share of the
        training episodes, a fixed draw per task (`task_id`), the rest played as evaluations are."""
        o = self.options
        if o.soft_message != "train":
            return o.soft_message == "always"
        return purpose == "train" and (
            o.soft_message_share >= 1.0 or fixed_draw(f"{task_id}|soft") < o.soft_message_share
        )

    async def run(self, ctx: EpisodeContext) -> Outcome:
        o = self.options
        thread = ctx.open(ctx.task.prompt)
        view = View(prompt_len=len(thread))
        transport = ctx.tools(self.registry)
        if isinstance(transport, LocalTransport):
            # In-process calls: build the backend now, so a missing one fails the episode loudly
            # instead of every call coming back as a tool crash.
            self.backend()
        runner = TurnRunner(o, self.renderer, self.count_tokens, ctx, transport)
        soft = self.training(ctx.purpose, ctx.task.task_id)
        steps = 0  # tool invocations + 1 for the final turn (Outcome.steps: a parent's critical steps)
        for _ in range(o.max_turns):
            room = o.budget_tokens - len(thread)
            if room < 8:
                ctx.count("budget_exhausted")
                return Outcome(final_text="", finish_reason="budget", steps=steps)
            start = len(thread)
            gen = await ctx.generate(thread, max_tokens=min(o.reserve_tokens, room), stop=["\n"])
            view.add("policy", gen.text, start)
            parsed = self.renderer.parse(
                gen.text, self.model_registry, call_id_prefix=f"{thread.sample_id}-t{gen.turn}"
            )
            if not parsed.items:
                return Outcome(final_text=gen.text, finish_reason=gen.finish_reason, steps=steps + 1)
            steps += len(parsed.items)
            text, thread = await runner.turn(parsed.items, thread, view, gen.turn)
            start = len(thread)
            ctx.observe(thread, text)
            view.add("observation", text, start)
            used = len(thread)
            status = usage_line(used, o.budget_tokens)
            if soft and used > o.budget_tokens / 2:
                status += SOFT_MESSAGE
                ctx.count("soft_messages")
            start = len(thread)
            ctx.observe(thread, status)
            view.add("observation", status, start)
        return Outcome(final_text="", finish_reason="max_turns", steps=steps)

    # -- scoring ------------------------------------------------------------------------------------

    def grade_episode(self, task: TaskSpec, episode: Episode) -> Score:
        seen = {doc_of(c) for ev in episode.tool_log if ev.status == "ok" for c in _chunks(ev.info)}
        calls = [ev.name for ev in episode.tool_log]
        # The version that sampled the episode is the learner's step count when it was published:
        # F_beta's beta follows the run's schedule through it (an unsampled episode counts as 0).
        version = max(0, episode.oldest_version())
        return self._grade(task, episode.final_text, seen, calls, episode.counts.get("turns", 1), version=version)

    def grade(self, task: TaskSpec, completion: str) -> Score:
        output = parse_output(completion, self.options.max_output_docs) or []
        return self._grade(task, completion, set(output), [], 1, version=0)

    def _grade(
        self, task: TaskSpec, final: str, seen: set[str], calls: list[str], turns: int, *, version: int
    ) -> Score:
        output = parse_output(final, self.options.max_output_docs)
        if output is None:
            return self.failure("no final output: expected <docs>ids</docs>")
        meta = task.metadata
        config = self.options.reward_config(version)
        b = rw.reward(
            output=output,
            targets=set(meta["targets"].split()),
            seen=seen,
            answer_docs=set(meta["answer_docs"].split()),
            tool_calls=calls,
            turns=turns,
            config=config,
        )
        reason = (
            f"P={b.precision:.2f} R={b.recall:.2f} traj={b.traj_recall:.2f} "
            f"answer={'found' if b.final_answer else 'missed'} beta={config.beta:g}"
        )
        return Score.of(b.components, correct=b.final_answer, parse_ok=True, reason=reason)


def _chunks(info: dict[str, Any]) -> list[str]:
    return [c for c in str(info.get("chunks", "")).split(",") if c]


__all__ = ["Search", "SearchOptions", "parse_output", "prompt_of", "question_prompt"]
