"""`swarm`: a trainable orchestrator over frozen search sub-agents (K2.5 Agent Swarm / PARL, issue 15).

The orchestrator gets a prompt listing several search questions (tasks.py) and must end with
one line `<docs>id id ...</docs>` holding every document that answers them. Its tools
(tools.py): the direct search tools of the `search` env (search_corpus, grep_corpus,
read_document) and, in `swarm` mode, `create_subagent(name, system_prompt)` and
`assign_task(agent, prompt)`. One turn is one line (generation stops at "\\n"); a turn without
a call is the final answer.

Sub-agents. Each assign_task runs one `search` episode (Context-1's retrieval sub-agent: its own
context, token budget and turn limit, the search tools, ending with `<docs>ids</docs>`) through
`EpisodeContext.spawn(..., role="subagent", trainable=False)`: its samples join the episode
untrainable, and it runs wherever the harness puts frozen agents (the frozen engine in this
process, or a sub-agent pool). The child is the registered `search` env with the plain options
in `SwarmOptions.search`, and its task's prompt is the search prompt of the assigned text, so a
pool can rebuild both. The assign_task calls of one turn run concurrently (`asyncio.gather`);
the orchestrator sees only each sub-agent's final message, as that call's result. The
sub-agent's system prompt (create_subagent) reaches chat models through `chat_messages`; a
byte-level model without a chat template sees the task prompt only.

References (`by_reference`, swarm mode): an assign_task prompt that is an item's number (`"3"`,
the prompt's question lines counted from 1) gives the sub-agent that item's question (a number
out of range is refused), and a sub-agent's name in the final `<docs>` list stands for the ids it
returned and `*` for every id any sub-agent returned (the answer is graded as so expanded;
`Outcome.final_text` holds the expansion). The
orchestrator then copies no text from its prompt or its observations; what is left for it to learn is
how many sub-agents, which item each gets and in how many turns.

Each turn's observation is the calls' results, in call order (creates run first, so one turn may
create and assign), then the step line `[Steps: X/B]` (critical steps used / the budget).

Critical steps (steps.py): a turn costs 1 (its calls run together, as PARL's S_main) plus the
longest sub-agent of its cohort (its tool calls + 1 for its final message, `Outcome.steps`); a
malformed call costs nothing beyond its turn's step and is counted (`malformed_calls`). Past `max_critical_steps`
the episode ends with finish reason "critical_steps" and no answer: the run stops as soon as the
steps used leave no step for the answer. `max_turns` bounds the orchestrator's turns, the search
options' `max_turns` each sub-agent's.

Reward (named components, raw; the learner weights them, `[learner.reward_schedule.<name>]`):
- `perf` = fraction of the required documents in the answer (the first required + `extra_docs`
  ids are read); correct = all of them;
- `parallel` = min(1, n / `parallel_cap`) (PARL rebuild's form, a small cap), n the distinct
  sub-agents (by name) that returned finished work: one sub-agent given four tasks is 1, never 4;
- `finish` = finished / max(1, assigned), an assignment finished when its sub-agent's final
  message parses as a non-empty `<docs>` list (an empty `<docs></docs>` is not a result).
A missing answer scores perf 0 (parse_ok False) and keeps the auxiliary terms. Counts on the
episode: critical_steps, total_steps, malformed_calls (the orchestrator's calls the parser
refused), subagents (one per assignment, counted by spawn), subagents_created,
subagents_finished, parallel_agents (distinct sub-agents with finished work: r_parallel's n),
serial_collapse (swarm mode, 2+ items, no sub-agent) and spurious_parallel (a created sub-agent
that finished no task).

Also counted: parallel_turns (turns whose cohort ran 2+ sub-agents at once; an episode with one
is a parallel episode, `eval_metrics`' parallel_rate) and wall_ms (the episode's wall-clock time,
sub-agents included, wherever they ran: the latency the critical steps stand for).

`single` mode (issue 32): the single agent trained in its own right, the swarm's baseline: the
same tasks and budget, the direct search tools only, its own system prompt and a prompt that
opens with the mode token `[single]` (tasks.SINGLE_TAG: a byte-level model never sees a system
prompt), its own teacher (the scripted orchestrator's serial episodes) and its own RL run.
"""

from __future__ import annotations

import asyncio
import functools
import random
import re
import time
from typing import Any, ClassVar

import msgspec

from slipstream.envs.base import SPLITS, Environment, Problem, Score, Split, TaskSpec
from slipstream.envs.context import ContextFull, EpisodeContext, Outcome
from slipstream.envs.registry import parse_options, register
from slipstream.envs.search.env import SYSTEM_PROMPT as SEARCH_SYSTEM_PROMPT
from slipstream.envs.search.env import Search, question_prompt
from slipstream.envs.search.generator import SearchTask
from slipstream.envs.search.tools import READ, chunk_blocks, doc_of, parse_output
from slipstream.envs.swarm import expert as expert_policy
from slipstream.envs.swarm import tasks as tk
from slipstream.envs.swarm.options import SwarmOptions
from slipstream.envs.swarm.steps import Ledger
from slipstream.envs.swarm.tools import ASSIGN, CREATE, orchestrator_tools
from slipstream.schemas import Episode
from slipstream.toolcalls import LocalTransport, MalformedCall, ToolCall, ToolResult, execute, renderer_for, tool_event

COMPONENTS: tuple[str, ...] = ("perf", "parallel", "finish")
_DOCS_BODY = re.compile(r"<docs>(.*?)</docs>", re.DOTALL)


@functools.lru_cache(maxsize=8)
def _search_env(options: bytes) -> Search:
    """The sub-agents' env (one per option set, so its corpus and backend are built once)."""
    env = Search(parse_options("search", msgspec.json.decode(options)))  # type: ignore[arg-type]
    return env


def _system_prompt(mode: str) -> str:
    swarm = (
        " create_subagent(name, system_prompt) defines a sub-agent; assign_task(agent, prompt) gives it a task, "
        "several may run at once and each returns the sub-agent's final message."
        if mode == "swarm"
        else ""
    )
    return (
        "Find every document that answers each listed question; do NOT answer the questions. Tools: "
        "search_corpus(query), grep_corpus(pattern), read_document(doc_id)." + swarm + " Each tool call is one "
        '<tool>{"name": ..., "args": {...}}</tool> on a single line. The step line [Steps: X/B] counts the '
        "critical steps used; past B the episode ends unanswered. End with one line <docs>doc ids</docs>."
    )


@register("swarm")
class Swarm(Environment[SwarmOptions]):
    """Orchestrate search sub-agents (or search directly) to find every listed question's documents."""

    version: ClassVar[str] = "1"
    Options: ClassVar[type[msgspec.Struct]] = SwarmOptions
    components: ClassVar[tuple[str, ...]] = COMPONENTS
    warmstart_from_expert: ClassVar[bool] = True
    warmstart_frozen_samples: ClassVar[bool] = True
    max_turns: ClassVar[int] = 1024  # the option `max_turns` is the real bound

    def warmstart_frozen_rows(self) -> int | None:
        rows = self.options.warmstart_subagent_rows
        return None if rows < 0 else rows

    def __init__(self, options: SwarmOptions | None = None) -> None:
        super().__init__(options)
        self.search: Search = _search_env(msgspec.json.encode(self.options.search))
        self.renderer = renderer_for("tags")
        self.model_registry = orchestrator_tools(self.options.mode)

    @property
    def max_completion_chars(self) -> int:
        return self.options.turn_tokens

    # -- tasks ----------------------------------------------------------------------------------

    @functools.cached_property
    def pools(self) -> dict[str, list[SearchTask]]:
        """The corpus's train-split search tasks that serve as wide items and deep branches."""
        train = [t for t in self.search.corpus.tasks if self.search.split_of(t.key) == "train"]
        return {
            "wide": [t for t in train if t.hops == self.options.wide_hops],
            "deep": [t for t in train if t.hops == self.options.deep_hops] if self.options.deep_rate > 0 else [],
        }

    @functools.cached_property
    def split_pools(self) -> dict[str, dict[str, list[SearchTask]]]:
        """`pools` by split: under `heldout_items = "unseen"` each item goes to its documents'
        split (tasks.item_split; a straddling item to neither), else every split has every item."""
        if self.options.heldout_items != "unseen":
            return {split: self.pools for split in SPLITS}
        one_in = self.options.heldout_one_in
        return {
            split: {
                kind: [t for t in pool if tk.item_split(t.targets, one_in) == split]
                for kind, pool in self.pools.items()
            }
            for split in SPLITS
        }

    @functools.cached_property
    def _heldout_item_keys(self) -> frozenset[str]:
        return frozenset(t.key for pool in self.split_pools["heldout"].values() for t in pool)

    def split_of(self, key: str) -> Split:
        if self.options.heldout_items == "unseen":
            held = self._heldout_item_keys
            return "heldout" if any(k in held for k in tk.item_keys(key)) else "train"
        return "heldout" if tk.split_of(key, self.options.heldout_one_in) == "heldout" else "train"

    def _draw(self, rng: random.Random, split: Split = "train") -> tuple[str, list[tk.Item]]:
        o = self.options
        return tk.draw(
            rng,
            self.split_pools[split],
            deep_rate=o.deep_rate,
            wide=(o.wide_min, o.wide_max),
            branches=o.deep_branches,
            layout=o.layout,
            counts=o.item_counts,
        )

    def sample(self, rng: random.Random) -> Problem:
        kind, items = self._draw(rng)
        return Problem(
            key=tk.task_key(kind, items),
            prompt=tk.prompt(items, self.options.layout, self.options.mode, self.options.agenda),
            reference=" ".join(tk.required(items)),
        )

    def generate(self, split: Split, n: int, seed: int) -> list[TaskSpec]:
        """`n` tasks of `split`: a pure function of (options, split, n, seed); the first k are the
        same for every n >= k."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        rng = random.Random(f"{self.name}|{split}|{seed}")
        out: list[TaskSpec] = []
        draws = 0
        while len(out) < n:
            if draws >= 1000 + 64 * n:
                raise ValueError(f"swarm: drew {draws} tasks and found only {len(out)} of split {split!r}")
            kind, items = self._draw(rng, split)
            draws += 1
            meta = tk.metadata_of(kind, items)
            if self.split_of(meta["key"]) != split:
                continue
            if split == "train" and self.options.train_budgets:
                # its own stream, so the items drawn are those of a plan without train_budgets
                pick = random.Random(f"{self.name}|budget|{seed}|{len(out)}")
                meta["budget"] = str(pick.choice(self.options.train_budgets))
            out.append(
                TaskSpec(
                    task_id=f"{self.name}-{split}-{seed}-{len(out)}",
                    env=self.name,
                    prompt=tk.prompt(items, self.options.layout, self.options.mode, self.options.agenda),
                    reference=" ".join(tk.required(items)),
                    seed=seed,
                    split=split,
                    metadata=meta,
                )
            )
        return out

    def chat_messages(self, task: TaskSpec, prompt: str) -> list[dict[str, str]]:
        """For chat models: the orchestrator's system prompt for its mode, or a sub-agent's own
        (create_subagent's), falling back to the search env's."""
        if task.env == self.search.name:
            system = task.metadata.get("system_prompt") or SEARCH_SYSTEM_PROMPT
        else:
            system = _system_prompt(self.options.mode)
        return [{"role": "system", "content": system}, {"role": "user", "content": prompt}]

    def sft_example(self, task: TaskSpec) -> str:
        return f"<docs>{task.reference}</docs>\n"

    def expert(self, task: TaskSpec, context: str) -> str:
        return expert_policy.next_turn(self.options, self.search, task, context)

    # -- the episode ------------------------------------------------------------------------------

    async def run(self, ctx: EpisodeContext) -> Outcome:
        return await _Episode(self, ctx).play()

    # -- scoring ------------------------------------------------------------------------------------

    def _perf(self, task: TaskSpec, final: str) -> tuple[float, bool, str]:
        need = task.reference.split()
        output = parse_output(final, max(1, len(need) + self.options.extra_docs))
        if output is None:
            return 0.0, False, "no final output: expected <docs>ids</docs>"
        found = len(set(output) & set(need))
        return found / max(1, len(need)), True, f"found {found}/{len(need)}"

    def grade_episode(self, task: TaskSpec, episode: Episode) -> Score:
        perf, parsed, reason = self._perf(task, episode.final_text)
        c = episode.counts
        spawned, finished = c.get("subagents", 0), c.get("subagents_finished", 0)
        agents = c.get("parallel_agents", 0)
        components = {
            "perf": perf,
            "parallel": min(1.0, agents / self.options.parallel_cap),
            "finish": finished / max(1, spawned),
        }
        reason += (
            f"; {spawned} assignment(s), {finished} finished, by {agents} sub-agent(s); "
            f"{c.get('critical_steps', 0)} critical steps"
        )
        if episode.finish_reason == "critical_steps":
            reason += " (over the budget)"
        return Score.of(components, correct=perf == 1.0, parse_ok=parsed, reason=reason)

    def probe_episode(self, task: TaskSpec, episode: Episode) -> bool:
        """A serial teacher answers with the items it reached in budget (one of N at the demo's budget
        of 4): never `correct`, so the default probe would measure only the rare parallel episodes,
        the behaviour a warm-start without it must not hold (issue 32), and never stop. Clean here:
        no invalid or malformed call, every assignment finished, and every answered id required."""
        c = episode.counts
        if c.get("invalid_tool_call", 0) or c.get("malformed_calls", 0):
            return False
        if c.get("subagents_finished", 0) < c.get("subagents", 0):
            return False
        need = task.reference.split()
        output = parse_output(episode.final_text, max(1, len(need) + self.options.extra_docs))
        return output is not None and len(output) > 0 and set(output) <= set(need)

    def grade(self, task: TaskSpec, completion: str) -> Score:
        perf, parsed, reason = self._perf(task, completion)
        return Score.of(
            {"perf": perf, "parallel": 0.0, "finish": 0.0}, correct=perf == 1.0, parse_ok=parsed, reason=reason
        )

    def eval_metrics(self, tasks: list[TaskSpec], episodes: list[Episode]) -> dict[str, float]:
        """accuracy, perf, critical/total steps, assignments, sub-agents with finished work and
        malformed calls (means), finish rate, the parallel rate (share of episodes with a turn that
        ran 2+ sub-agents at once), the mean wall-clock latency per episode in seconds, and the
        serial-collapse, spurious-parallelism and over-budget episode counts."""
        n = max(1, len(episodes))
        scores = [self.score(t, e) for t, e in zip(tasks, episodes, strict=True)]

        def total(name: str) -> float:
            return float(sum(e.counts.get(name, 0) for e in episodes))

        return {
            "accuracy": sum(s.correct for s in scores) / n,
            "perf": sum(s.components.get("perf", 0.0) for s in scores) / n,
            "critical_steps": total("critical_steps") / n,
            "total_steps": total("total_steps") / n,
            "subagents": total("subagents") / n,
            "parallel_agents": total("parallel_agents") / n,
            "finish_rate": total("subagents_finished") / max(1.0, total("subagents")),
            "malformed_calls": total("malformed_calls") / n,
            "serial_collapse": total("serial_collapse"),
            "spurious_parallel": total("spurious_parallel"),
            "over_budget": float(sum(e.finish_reason == "critical_steps" for e in episodes)),
            "parallel_rate": sum(e.counts.get("parallel_turns", 0) > 0 for e in episodes) / n,
            "latency_s": total("wall_ms") / 1000 / n,
        }


class _Episode:
    """One orchestrator episode's state: the ledger, the sub-agents, the chunks seen directly."""

    def __init__(self, env: Swarm, ctx: EpisodeContext) -> None:
        self.env = env
        self.ctx = ctx
        self.o = env.options
        self.ledger = Ledger()
        self.created: dict[str, str] = {}  # name -> system prompt
        self.finished_by: dict[str, int] = {}  # name -> tasks it finished
        self.returned_by: dict[str, list[str]] = {}  # name -> the ids its finished tasks returned
        self.spawned = 0
        self.finished = 0
        self.own_steps = 0
        self.seen: dict[str, None] = {}  # chunk ids the orchestrator's direct calls returned
        self.items = tk.items_of(ctx.task.metadata) if "items" in ctx.task.metadata else []
        self.parallel_turns = 0  # turns whose cohort ran 2+ sub-agents at once
        self.turns = 0  # turns with calls (the single agent's agenda advances one item each)
        self.started = time.monotonic()
        self.budget = env.options.budget(ctx.task.metadata)

    async def play(self) -> Outcome:
        ctx, o, env = self.ctx, self.o, self.env
        thread = ctx.open(ctx.task.prompt)
        transport = ctx.tools(env.search.registry)
        if isinstance(transport, LocalTransport):
            env.search.backend()  # fail loudly now rather than on every call
        for _ in range(o.max_turns):
            try:
                gen = await ctx.generate(thread, max_tokens=o.turn_tokens, stop=["\n"])
            except ContextFull:
                return self.end("", "length")
            parsed = env.renderer.parse(gen.text, env.model_registry, call_id_prefix=f"{thread.sample_id}-t{gen.turn}")
            if not parsed.items:
                self.ledger.add(0)
                self.own_steps += 1
                if self.ledger.critical > self.budget:
                    return self.end("", "critical_steps")
                return self.end(gen.text, gen.finish_reason)
            self.own_steps += len(parsed.items)
            results, direct, subs = await self.turn(list(parsed.items), thread.sample_id, gen.turn, transport)
            malformed = sum(1 for i in parsed.items if isinstance(i, MalformedCall))
            self.ledger.add(direct - malformed, subs, malformed=malformed)
            self.parallel_turns += len(subs) >= 2
            text = env.renderer.render(env.renderer.result_messages(results))
            text += f"[Steps: {self.ledger.critical}/{self.budget}]\n"
            self.turns += 1
            if o.agenda and self.turns < len(self.items):  # single by reference: the next item, one a turn
                text += tk.agenda_line(self.items[self.turns])
            try:
                ctx.observe(thread, text)
            except ContextFull:
                return self.end("", "length")
            if self.ledger.critical + 1 > self.budget:
                return self.end("", "critical_steps")  # no step left for the answer
        return self.end("", "max_turns")

    async def turn(
        self, items: list[ToolCall | MalformedCall], sample_id: str, turn: int, transport: Any
    ) -> tuple[list[ToolResult], int, list[int]]:
        """Run one turn's calls: creates first, then the direct calls and the assignments at once.
        Returns the results in call order, the direct-call count and each sub-agent's steps."""
        results: dict[int, ToolResult] = {}
        for n, item in enumerate(items):
            if isinstance(item, ToolCall) and item.name == CREATE:
                results[n] = self.create(item)
        direct = [(n, i) for n, i in enumerate(items) if not (isinstance(i, ToolCall) and i.name in (CREATE, ASSIGN))]
        assigns = [(n, i) for n, i in enumerate(items) if isinstance(i, ToolCall) and i.name == ASSIGN]
        runnable: list[tuple[int, ToolCall]] = []
        for n, call in assigns:
            refusal = self.refusal(call, len(runnable))
            if refusal:
                results[n] = ToolResult(call_id=call.id, name=ASSIGN, outcome="invalid_tool_call", text=refusal)
            else:
                runnable.append((n, call))
        calls = [self.with_hidden(i) if isinstance(i, ToolCall) else i for _, i in direct]
        done, spawned = await asyncio.gather(
            execute(calls, transport), asyncio.gather(*(self.assign(c) for _, c in runnable))
        )
        for (n, _), result in zip(direct, done, strict=True):
            results[n] = result
        steps: list[int] = []
        for (n, _), (result, s) in zip(runnable, spawned, strict=True):
            results[n] = result
            steps.append(s)
        for n, item in enumerate(items):
            event = tool_event(item, results[n], sample_id=sample_id, turn=turn)
            ids = [c for c, _ in chunk_blocks(results[n].text)] if results[n].outcome == "ok" else []
            if ids and n in dict(direct):
                event.info["chunks"] = ",".join(ids)
                self.seen.update(dict.fromkeys(ids))
            self.ctx.log_tool(event)
        return [results[n] for n in range(len(items))], len(direct), steps

    def with_hidden(self, call: ToolCall) -> ToolCall:
        args: dict[str, Any] = dict(call.arguments)
        args["_exclude"] = [] if call.name == READ else list(self.seen)
        args["_budget"] = self.env.search.options.search_tokens
        return ToolCall(id=call.id, name=call.name, arguments=args, raw=call.raw)

    def create(self, call: ToolCall) -> ToolResult:
        name = str(call.arguments["name"])
        if name in self.created:
            text, ok = f"error: a sub-agent named {name} exists already", False
        elif len(self.created) >= self.o.max_subagents:
            text, ok = f"error: at most {self.o.max_subagents} sub-agents per episode", False
        else:
            self.created[name] = str(call.arguments["system_prompt"])
            self.finished_by[name] = 0
            self.returned_by[name] = []
            text, ok = f"created {name}", True
        return ToolResult(call_id=call.id, name=CREATE, outcome="ok" if ok else "invalid_tool_call", text=text)

    def refusal(self, call: ToolCall, queued: int) -> str:
        agent = str(call.arguments["agent"])
        if agent not in self.created:
            return f"error: no sub-agent named {agent}; create it first with {CREATE}"
        if queued >= self.o.max_assign_per_turn:
            return f"error: at most {self.o.max_assign_per_turn} {ASSIGN} calls per turn"
        number = self.item_number(call)
        if number is not None and not 1 <= number <= len(self.items):
            return f"error: no item {number}; the task lists items 1 to {len(self.items)}"
        return ""

    def item_number(self, call: ToolCall) -> int | None:
        """The item an assignment names by its number (`by_reference`), else None (a prompt in words)."""
        text = str(call.arguments["prompt"]).strip()
        return int(text) if self.o.by_reference and self.o.mode == "swarm" and text.isdigit() else None

    def expand_answer(self, final: str) -> str:
        """`by_reference`: each sub-agent named in the answer's `<docs>` list stands for the ids it
        returned, and `*` for every id any sub-agent returned; in single mode `*` stands for every
        document the agent's own calls returned, in the order they came."""
        if not self.o.by_reference or not (self.returned_by or (self.o.mode == "single" and self.seen)):
            return final
        if self.o.mode == "single":
            every = list(dict.fromkeys(doc_of(c) for c in self.seen))
        else:
            every = [i for ids in self.returned_by.values() for i in ids]

        def ids(m: re.Match[str]) -> str:
            words = re.split(r"[\s,]+", m.group(1).strip())
            out = [i for w in words if w for i in (every if w == "*" else self.returned_by.get(w, [w]))]
            return f"<docs>{' '.join(out)}</docs>"

        return _DOCS_BODY.sub(ids, final, count=1)

    async def assign(self, call: ToolCall) -> tuple[ToolResult, int]:
        """One sub-agent episode on the assigned prompt; its final message is the result."""
        ctx, search = self.ctx, self.env.search
        agent = str(call.arguments["agent"])
        question = str(call.arguments["prompt"])
        number = self.item_number(call)
        if number is not None:  # checked in range by `refusal`
            question = self.items[number - 1].question
        k = self.spawned
        self.spawned += 1
        parent = ctx.task
        child = TaskSpec(
            task_id=f"{parent.task_id}/{agent}-{k}",
            env=search.name,
            prompt=question_prompt(question, tools_line=search.options.tools_line),
            reference="",
            seed=parent.seed,
            split=parent.split,
            metadata={
                "key": f"{parent.metadata.get('key', parent.task_id)}/{agent}-{k}",
                "question": question,
                "agent": agent,
                "system_prompt": self.created[agent],
            },
        )
        try:
            outcome = await ctx.spawn(search, child, agent_id=f"{agent}.{k}", role="subagent", trainable=False)
        except ContextFull:
            outcome = Outcome(final_text="", finish_reason="length", steps=0)
        final = outcome.final_text.strip()
        finished = bool(parse_output(final, search.options.max_output_docs))  # an empty <docs></docs> is no result
        if finished:
            self.finished += 1
            self.finished_by[agent] += 1
            self.returned_by[agent] += parse_output(final, search.options.max_output_docs) or []
        text = final or f"error: {agent} ended without a final message ({outcome.finish_reason or 'unknown'})"
        # A child that does not count its steps (Outcome.steps 0) is charged one: it ran at least a turn.
        return ToolResult(call_id=call.id, name=ASSIGN, outcome="ok", text=text), max(1, outcome.steps)

    def end(self, final: str, reason: str) -> Outcome:
        ctx = self.ctx
        ctx.count("critical_steps", self.ledger.critical)
        ctx.count("total_steps", self.ledger.total)
        ctx.count("subagents", 0)  # spawn counts one per assignment; the key exists either way
        ctx.count("subagents_created", len(self.created))
        ctx.count("subagents_finished", self.finished)
        ctx.count("parallel_agents", sum(1 for n in self.finished_by.values() if n > 0))
        ctx.count("malformed_calls", self.ledger.malformed)
        collapse = self.o.mode == "swarm" and len(self.items) >= 2 and self.spawned == 0
        ctx.count("serial_collapse", int(collapse))
        ctx.count("spurious_parallel", int(any(n == 0 for n in self.finished_by.values())))
        ctx.count("parallel_turns", self.parallel_turns)
        # Wall-clock latency of the whole episode (the orchestrator's turns and its sub-agents,
        # wherever they ran: this engine, a frozen one or the pool), in milliseconds.
        ctx.count("wall_ms", round(1000 * (time.monotonic() - self.started)))
        return Outcome(final_text=self.expand_answer(final), finish_reason=reason, steps=self.own_steps)
