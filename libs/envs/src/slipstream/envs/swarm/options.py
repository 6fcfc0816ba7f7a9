"""`SwarmOptions`: the options of the `swarm` environment (sub-agents' search env, tasks, limits, reward, expert).

Its own module because the environment and its scripted orchestrator (expert.py) both read them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from slipstream.envs.registry import parse_options
from slipstream.envs.swarm import tasks as tk

Doc = msgspec.Meta
Mode = Literal["swarm", "single"]
HeldoutItems = Literal["combinations", "unseen"]
ExpertSubagents = Literal["shared", "per_item"]
SerialOrder = Literal["listed", "last_first"]
Cite = Literal["names", "all"]


class SwarmOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Options of `swarm`: the corpus and sub-agents (`search`), the tasks, the limits, the reward."""

    search: Annotated[
        dict[str, Any],
        Doc(description="Options of the `search` env: the corpus, the direct tools and the sub-agents' harness."),
    ] = {}
    mode: Annotated[
        Mode, Doc(description="'swarm': with create_subagent/assign_task; 'single': direct tools only.")
    ] = "swarm"
    layout: Annotated[
        tk.Layout,
        Doc(
            description="'lines': the questions as worded, one a line; 'fixed': one-hop questions in brief form, "
            "each prompt line as wide as the assign_task call carrying it; 'brief': the brief forms, unpadded "
            "(tasks.py)."
        ),
    ] = "lines"
    item_counts: Annotated[
        list[int],
        Doc(description="Item counts N a wide task draws from, uniformly (e.g. [2, 4, 8]); []: wide_min..wide_max."),
    ] = []
    heldout_items: Annotated[
        HeldoutItems,
        Doc(
            description="'combinations': held-out tasks are unseen combinations of items that train tasks also use; "
            "'unseen': the items' documents are split by hash, and a held-out task's items (their documents, "
            "entities and questions) never occur in a train task (tasks.py)."
        ),
    ] = "combinations"
    wide_min: Annotated[int, Doc(description="Fewest items of a wide task.")] = 4
    wide_max: Annotated[int, Doc(description="Most items of a wide task.")] = 5
    wide_hops: Annotated[int, Doc(description="Hops of a wide task's items.")] = 1
    deep_rate: Annotated[float, Doc(description="Share of deep tasks (branches of several hops).")] = 0.0
    deep_branches: Annotated[int, Doc(description="Branches of a deep task.")] = 3
    deep_hops: Annotated[int, Doc(description="Hops of each deep branch (needs the corpus's max_hops).")] = 2
    max_turns: Annotated[int, Doc(description="Orchestrator turns per episode.")] = 8
    turn_tokens: Annotated[int, Doc(description="Most tokens one orchestrator turn may sample.")] = 1024
    max_critical_steps: Annotated[
        int, Doc(description="Critical-step budget: past it the episode ends unanswered ('critical_steps').")
    ] = 4
    parallel_cap: Annotated[int, Doc(description="Sub-agents at which r_parallel = min(1, n / cap) saturates.")] = 4
    max_subagents: Annotated[int, Doc(description="Sub-agents one episode may create.")] = 4
    max_assign_per_turn: Annotated[int, Doc(description="assign_task calls one turn may make.")] = 8
    extra_docs: Annotated[int, Doc(description="Ids read from the answer beyond the required count.")] = 2
    expert_parallel_rate: Annotated[
        float, Doc(description="Share of tasks the scripted orchestrator solves in parallel (else serially).")
    ] = 0.5
    expert_subagents: Annotated[
        ExpertSubagents,
        Doc(
            description="'shared': the scripted orchestrator's parallel episodes give every item to one sub-agent and "
            "its serial ones call the search tools directly; 'per_item': one sub-agent per item in both, and a "
            "serial episode creates and assigns one item a turn (a teacher that knows the swarm tools but works "
            "serially; issue 32). Single mode is always direct."
        ),
    ] = "shared"
    expert_serial_order: Annotated[
        SerialOrder,
        Doc(
            description="Which item the per-item teacher's serial turns take first: 'listed' (the prompt's first) or "
            "'last_first' (the prompt's last line, then upwards). In the fixed layout the last line's brief sits one "
            "distance before the first assignment for every item count, the first line's a distance that grows with N."
        ),
    ] = "listed"
    by_reference: Annotated[
        bool,
        Doc(
            description="Swarm mode: an assign_task prompt that is an item's number ('1' .. 'N', the prompt's "
            "question lines counted from 1) gives the sub-agent that item's question, and a final answer may name "
            "sub-agents (`<docs>a b</docs>`), each standing for the ids that sub-agent returned, or `*` for all. "
            "The orchestrator then copies no text: what it decides is how many sub-agents, which item each gets "
            "and in how many turns (issue 32: the micro model forms no positional copy of a brief; README, 'swarm'). "
            "Single mode: the agenda: the prompt and each turn's observation end with the next item's question "
            "as a sub-agent's prompt words it (one item a turn, in order), and `*` in the answer stands for every "
            "document the agent's own calls returned, so the single agent copies what a sub-agent copies, from "
            "the line it just read, and nothing from further back."
        ),
    ] = False
    cite: Annotated[
        Cite,
        Doc(
            description="With by_reference, how the scripted orchestrator's answer cites its sub-agents' results: "
            "'names' (`<docs>a b</docs>`) or 'all' (`<docs>*</docs>`: every result returned; the env accepts "
            "both forms either way)."
        ),
    ] = "names"
    train_budgets: Annotated[
        list[int],
        Doc(
            description="Critical-step budgets a train task draws from (one per task, uniformly; repeat a value to "
            "weight it), kept in its metadata ('budget'); []: every task has max_critical_steps. Held-out tasks "
            "always have max_critical_steps. Lets the serial teacher's episodes run several turns (issue 32)."
        ),
    ] = []
    heldout_one_in: Annotated[int, Doc(description="One task key in this many is held out.")] = 8
    warmstart_subagent_rows: Annotated[
        int,
        Doc(
            description="Sub-agent samples of one expert episode that warm-start the model (its first ones); "
            "-1: all. Fewer puts more of the orchestrator's own rows in each batch."
        ),
    ] = -1

    def __post_init__(self) -> None:
        if not 1 <= self.wide_min <= self.wide_max <= 32:
            raise ValueError(f"need 1 <= wide_min <= wide_max <= 32, got {self.wide_min}, {self.wide_max}")
        if not 1 <= self.wide_hops <= 6 or not 1 <= self.deep_hops <= 6 or not 1 <= self.deep_branches <= 16:
            raise ValueError("need wide_hops and deep_hops in 1..6 and deep_branches in 1..16")
        for name, rate in (("deep_rate", self.deep_rate), ("expert_parallel_rate", self.expert_parallel_rate)):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {rate}")
        for name, value in (
            ("max_turns", self.max_turns),
            ("max_critical_steps", self.max_critical_steps),
            ("parallel_cap", self.parallel_cap),
            ("max_subagents", self.max_subagents),
            ("max_assign_per_turn", self.max_assign_per_turn),
        ):
            if not 1 <= value <= 1024:
                raise ValueError(f"{name} must be in 1..1024, got {value}")
        for b in self.train_budgets:
            if not 1 <= b <= 1024:
                raise ValueError(f"train_budgets must each be in 1..1024, got {self.train_budgets}")
        for n in self.item_counts:
            if not 1 <= n <= 32:
                raise ValueError(f"item_counts must each be in 1..32, got {self.item_counts}")
        if self.expert_subagents == "per_item" and max(self.counts) > len(tk.AGENT_NAMES):
            raise ValueError(f"expert_subagents 'per_item' names at most {len(tk.AGENT_NAMES)} sub-agents")
        if self.expert_subagents == "per_item" and self.mode == "swarm" and self.max_subagents < max(self.counts):
            raise ValueError(
                f"expert_subagents 'per_item' creates one sub-agent per item: max_subagents {self.max_subagents} "
                f"is below the largest item count {max(self.counts)}"
            )
        if not 16 <= self.turn_tokens <= 65_536:
            raise ValueError(f"turn_tokens must be in 16..65536, got {self.turn_tokens}")
        if not -1 <= self.warmstart_subagent_rows <= 1024:
            raise ValueError(
                f"warmstart_subagent_rows must be -1 (all) or in 0..1024, got {self.warmstart_subagent_rows}"
            )
        if not 0 <= self.extra_docs <= 100 or not 2 <= self.heldout_one_in <= 1000:
            raise ValueError("need 0 <= extra_docs <= 100 and 2 <= heldout_one_in <= 1000")
        if self.layout != "lines" and (self.deep_rate > 0 or self.wide_hops != 1):
            raise ValueError(
                f"layout {self.layout!r} briefs one-hop questions: needs deep_rate 0 and wide_hops 1, "
                f"got deep_rate {self.deep_rate}, wide_hops {self.wide_hops}"
            )
        if self.layout != "lines" and not self.search.get("fixed_offsets"):
            raise ValueError(
                f"layout {self.layout!r} briefs questions that name the decade last: needs search.fixed_offsets = true"
            )
        parse_options("search", self.search)  # names the bad search option, if any

    @property
    def agenda(self) -> bool:
        """Single mode by reference: the next item is shown after every turn (see `by_reference`)."""
        return self.mode == "single" and self.by_reference

    def budget(self, metadata: dict[str, str]) -> int:
        """A task's critical-step budget: its own (a train task under `train_budgets`), else max_critical_steps."""
        return int(metadata.get("budget") or self.max_critical_steps)

    @property
    def counts(self) -> list[int]:
        """The item counts a wide task may have."""
        return sorted(set(self.item_counts)) or list(range(self.wide_min, self.wide_max + 1))
