"""`search`: Context-1's retrieval sub-agent harness as a registered environment.

The model gets a question and four tools (tools.py) and must end with a ranked list of document
ids, `<docs>w0007 w0008</docs>`; it never answers the question itself. One turn is one line
(generation stops at "\\n"), holding tool calls in the tag protocol of libs/tools, possibly
several (parallel calls); a turn without a call is the final output.

The harness rules (techniques.md §4.2):
- seen-chunk exclusion: every chunk id a search, grep or read has returned is passed to later
  searches and greps as the hidden `exclude` argument (reads exclude only chunks still in view, so
  a pruned chunk can be read again); the model's schemas do not have it;
- a token budget (`budget_tokens`: 2,048 by default for the tiny byte-level model, 32,768 for a
  real one) over the sample the model continues; after every turn the observation ends with
  `[Token usage: X/Y]` (X counted after the turn's results were appended);
- past half the budget, in training rollouts only (split "train"; `soft_message`), a suggestion to
  prune or conclude follows the usage line;
- past `hard_cutoff` (a fraction in [0.5, 1]) every call but prune_chunks is refused with an
  error telling the model to prune or conclude (counted: `budget_refusals`);
- results are cut to `search_tokens` per call and to what the budget leaves after `reserve_tokens`
  (kept free for the model's next response, which may be at most that long);
- prune_chunks is a context edit: a new sample whose view has `[pruned: <id>]` for each pruned
  chunk (view.py); the tool log keeps every result unpruned (events whose chunks were all pruned
  are marked `hidden`), and the reward reads that log.

The reward is reward.py's, from the tool log and the final output; the expert is expert.py's.
"""

from __future__ import annotations

import functools
import math
import random
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from slipstream.envs.base import SPLITS, Environment, Problem, Score, Split, TaskSpec
from slipstream.envs.context import EpisodeContext, Outcome
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
from slipstream.schemas import Episode as EpisodeRecord
from slipstream.tools import LocalTransport, renderer_for

Doc = msgspec.Meta


class SearchOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Options of `search`: the corpus, the harness's budget rules, the reward."""

    corpus_seed: Annotated[int, Doc(description="Seed of the generated corpus and its tasks.")] = 0
    tasks_per_domain: Annotated[int, Doc(description="Tasks generated per domain.")] = 24
    max_hops: Annotated[int, Doc(description="Hop counts 1..max_hops.")] = 3
    distractors: Annotated[int, Doc(description="Distractor documents per task.")] = 2
    filler_per_domain: Annotated[int, Doc(description="Unrelated documents per domain.")] = 12
    doc_facts: Annotated[int, Doc(description="Extra filler facts per document.")] = 0
    heldout_domain: Annotated[str, Doc(description="The held-out split's domain.")] = "email"
    noise: Annotated[float, Doc(description="Generator slip rate that verification drops.")] = 0.05
    curriculum_phase: Annotated[int, Doc(description="1: skewed to few hops; 2: to many.")] = 1
    min_year: Annotated[int, Doc(description="Earliest year an entity dates from (the latest is 1999).")] = 1600
    unique_clues: Annotated[
        bool,
        Doc(description="No two documents share a (region, decade) pair: one-hop clues single out a document."),
    ] = False
    short_ids: Annotated[bool, Doc(description="Three-digit document ids drawn at random (417), not w0007.")] = False
    regions: Annotated[int, Doc(description="How many regions entities lie in (6..12).")] = 6
    fixed_offsets: Annotated[
        bool,
        Doc(
            description="Copies at fixed distances: the decade last in the question, a document's year first "
            "and its id last (`Id 417.`); with expert_grep the expert greps `from 187.*north`."
        ),
    ] = False
    varied_nouns: Annotated[
        bool,
        Doc(description="Training tasks draw their nouns (town, emblem, river) from pools; held-out ones keep theirs."),
    ] = False
    backend: Annotated[str, Doc(description="Search backend name (tools.register_backend).")] = "hybrid"
    budget_tokens: Annotated[int, Doc(description="Token budget of the model's context.")] = 2048
    search_tokens: Annotated[int, Doc(description="Most tokens one search/grep/read result may cost.")] = 512
    reserve_tokens: Annotated[int, Doc(description="Kept free for the next response (its max length).")] = 160
    hard_cutoff: Annotated[float, Doc(description="Fraction of the budget past which only prune runs.")] = 0.85
    soft_message: Annotated[
        Literal["train", "always", "never"], Doc(description="When the half-budget suggestion is shown.")
    ] = "train"
    max_turns: Annotated[int, Doc(description="Model turns per episode.")] = 16
    tools_line: Annotated[
        bool, Doc(description="The prompt lists the tools (False: the question only, for short CPU episodes).")
    ] = True
    max_output_docs: Annotated[int, Doc(description="Ranked ids read from the final output.")] = 5
    bytes_per_token: Annotated[float, Doc(description="Token estimate for backend budgets (1: bytes).")] = 1.0
    beta: Annotated[float, Doc(description="F_beta's beta (4, annealed to 2 by the trainer).")] = 4.0
    floor: Annotated[float, Doc(description="Reward floor for a trajectory that found something.")] = 0.01
    turn_start: Annotated[int, Doc(description="Turn penalty starts (0: 64 scaled with the budget).")] = 0
    turn_end: Annotated[int, Doc(description="Turn penalty peaks (0: 128 scaled with the budget).")] = 0
    expert_stop_rate: Annotated[
        float, Doc(description="Share of tasks on which the expert concludes one hop early (an imperfect teacher).")
    ] = 0.0
    expert_distractor_rate: Annotated[
        float, Doc(description="Share of tasks on which the expert also outputs a non-target document it saw.")
    ] = 0.0
    expert_grep: Annotated[
        bool, Doc(description="The expert finds the first hop with grep_corpus on the clues (region, decade).")
    ] = False
    expert_slip_rate: Annotated[
        float, Doc(description="With expert_grep: share of tasks whose first grep names the wrong decade.")
    ] = 0.0

    def __post_init__(self) -> None:
        if not 256 <= self.budget_tokens <= 1_000_000:
            raise ValueError(f"budget_tokens must be in 256..1000000, got {self.budget_tokens}")
        if not 0.5 <= self.hard_cutoff <= 1.0:
            raise ValueError(f"hard_cutoff must be in [0.5, 1], got {self.hard_cutoff}")
        if not 16 <= self.reserve_tokens <= self.budget_tokens // 4:
            raise ValueError(f"reserve_tokens must be in 16..budget_tokens/4, got {self.reserve_tokens}")
        if not 1 <= self.search_tokens <= self.budget_tokens:
            raise ValueError(f"search_tokens must be in 1..budget_tokens, got {self.search_tokens}")
        if not 1 <= self.max_turns <= 1024 or not 1 <= self.max_output_docs <= 100:
            raise ValueError("need 1 <= max_turns <= 1024 and 1 <= max_output_docs <= 100")
        if not self.bytes_per_token > 0:
            raise ValueError(f"bytes_per_token must be > 0, got {self.bytes_per_token}")
        for name, rate in (
            ("expert_stop_rate", self.expert_stop_rate),
            ("expert_distractor_rate", self.expert_distractor_rate),
            ("expert_slip_rate", self.expert_slip_rate),
        ):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {rate}")
        if self.curriculum_phase not in (1, 2):
            raise ValueError(f"curriculum_phase must be 1 or 2, got {self.curriculum_phase}")
        if (self.turn_start, self.turn_end) != (0, 0) and not 0 < self.turn_start < self.turn_end:
            raise ValueError(f"need 0 < turn_start < turn_end (or both 0), got {self.turn_start}, {self.turn_end}")
        rw.RewardConfig(beta=self.beta, floor=self.floor)  # validates both
        self.generator()  # validates the corpus options

    def generator(self) -> GeneratorOptions:
        return GeneratorOptions(
            seed=self.corpus_seed,
            tasks_per_domain=self.tasks_per_domain,
            max_hops=self.max_hops,
            distractors=self.distractors,
            filler_per_domain=self.filler_per_domain,
            doc_facts=self.doc_facts,
            heldout_domain=self.heldout_domain,
            noise=self.noise,
            min_year=self.min_year,
            unique_clues=self.unique_clues,
            short_ids=self.short_ids,
            regions=self.regions,
            fixed_offsets=self.fixed_offsets,
            varied_nouns=self.varied_nouns,
        )

    def reward_config(self) -> rw.RewardConfig:
        start, end = (self.turn_start, self.turn_end)
        if (start, end) == (0, 0):
            start, end = rw.scaled_turn_window(self.budget_tokens)
        return rw.RewardConfig(beta=self.beta, floor=self.floor, turn_start=start, turn_end=end)


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

    def curate_expert_episodes(self, tasks: list[TaskSpec], episodes: list[EpisodeRecord]) -> list[bool]:
        """Context-1's SFT filter (curation.py) over the expert's episodes."""
        cands = [
            candidate_of(t.metadata, e, reward=self.score(t, e).reward) for t, e in zip(tasks, episodes, strict=True)
        ]
        kept = set(sft_filter(cands).kept)
        return [e.episode_id in kept for e in episodes]

    def eval_metrics(self, tasks: list[TaskSpec], episodes: list[EpisodeRecord]) -> dict[str, float]:
        """Context-1's metrics (metrics.py) pooled over the episodes, without the `search/` prefix."""
        from slipstream.envs.search.metrics import aggregate, episode_metrics

        rows = [
            episode_metrics(t.metadata, e, max_output_docs=self.options.max_output_docs)
            for t, e in zip(tasks, episodes, strict=True)
        ]
        return {k.partition("/")[2]: v for k, v in aggregate(rows).items()}

    # -- the episode ------------------------------------------------------------------------------

    def training(self, task: TaskSpec) -> bool:
        """Whether the soft suggestion is shown: training rollouts only (by default)."""
        o = self.options.soft_message
        return o == "always" or (o == "train" and task.split == "train")

    async def run(self, ctx: EpisodeContext) -> Outcome:
        o = self.options
        thread = ctx.open(ctx.task.prompt)
        view = View(prompt_len=len(thread))
        transport = ctx.tools(self.registry)
        if isinstance(transport, LocalTransport):
            # In-process calls: build the backend now, so a missing one fails the episode loudly
            # instead of every call coming back as a tool crash.
            self.backend()
        runner = TurnRunner(self, ctx, transport)
        soft = self.training(ctx.task)
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

    def grade_episode(self, task: TaskSpec, episode: EpisodeRecord) -> Score:
        seen = {doc_of(c) for ev in episode.tool_log if ev.status == "ok" for c in _chunks(ev.info)}
        calls = [ev.name for ev in episode.tool_log]
        return self._grade(task, episode.final_text, seen, calls, episode.counts.get("turns", 1))

    def grade(self, task: TaskSpec, completion: str) -> Score:
        output = parse_output(completion, self.options.max_output_docs) or []
        return self._grade(task, completion, set(output), [], 1)

    def _grade(self, task: TaskSpec, final: str, seen: set[str], calls: list[str], turns: int) -> Score:
        output = parse_output(final, self.options.max_output_docs)
        if output is None:
            return self.failure("no final output: expected <docs>ids</docs>")
        meta = task.metadata
        b = rw.reward(
            output=output,
            targets=set(meta["targets"].split()),
            seen=seen,
            answer_docs=set(meta["answer_docs"].split()),
            tool_calls=calls,
            turns=turns,
            config=self.options.reward_config(),
        )
        reason = (
            f"P={b.precision:.2f} R={b.recall:.2f} traj={b.traj_recall:.2f} "
            f"answer={'found' if b.final_answer else 'missed'}"
        )
        return Score.of(b.components, correct=b.final_answer, parse_ok=True, reason=reason)


def _chunks(info: dict[str, Any]) -> list[str]:
    return [c for c in str(info.get("chunks", "")).split(",") if c]


__all__ = ["Search", "SearchOptions", "parse_output", "prompt_of", "question_prompt"]
