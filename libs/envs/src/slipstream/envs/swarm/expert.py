"""The scripted orchestrator: the teacher whose episodes warm-start the swarm model.

It reads only the decoded context of the sample it continues (as a model would) plus the task's
items (metadata). One engine plays every agent of an expert episode, so it first tells whose
context it is continuing:

- a sub-agent's (no swarm header; the search prompt `Find the documents that answer: <q>`): the
  `search` env's expert on the item whose question `<q>` is (search/expert.py), so the swarm
  warm-start also teaches the sub-agents' search skill;
- the orchestrator's: on a fixed share of tasks (`expert_parallel_rate`, a function of the task
  key; always 0 in `single` mode) it is **parallel**: one turn creating a sub-agent and assigning
  every item's question to it, then the final answer, the ids the sub-agents returned. Otherwise
  it is **serial**: the search expert's calls made directly, one per turn, item after item, and
  the final answer, the targets it saw. It watches the step line `[Steps: X/B]` and answers
  with what it has when one more call would leave no step for the answer, so a serial episode on
  a task too wide for the budget ends with a partial answer, not cut off. In single mode by
  reference (the agenda) it searches the item the agenda shows, one a turn as the agenda advances,
  and with `cite = "all"` answers `<docs>*</docs>`.

With `expert_subagents = "per_item"` (issue 32: a warm-start that does not contain the
parallel behaviour) it knows the swarm tools but uses one sub-agent per item (`AGENT_NAMES`, one
byte each): parallel, one turn creating all N then assigning item i to agent i; serial, one turn
per item creating its agent and assigning it that item alone, answering with the ids returned so
far when one more such turn (its cost estimated from the turns so far, else 1 + the sub-agent's
hops + 1) would leave no step for the answer. With `expert_parallel_rate` <= 0.1 the warm-start
then shows almost only serial work with the swarm tools: parallel assignment is left for RL.
With `by_reference` it assigns an item by its number and answers citing its sub-agents' results
(`cite`: their names, or `*` for all of them), and its parallel turn is the serial turns' pairs.
"""

from __future__ import annotations

import re

from slipstream.envs.base import TaskSpec, fixed_draw
from slipstream.envs.search.env import Search
from slipstream.envs.search.expert import call
from slipstream.envs.search.tools import doc_of
from slipstream.envs.swarm.options import SwarmOptions
from slipstream.envs.swarm.tasks import AGENT_NAMES, HEADER, LAYOUT_AGENT, Item, items_of
from slipstream.envs.swarm.tools import ASSIGN, CREATE

SUBAGENT_NAME = LAYOUT_AGENT
SUBAGENT_PROMPT = "Find the documents that answer the question; end with <docs>ids</docs>."
# The fixed layout's: every byte of the parallel turn lies between a brief and its copy, so short.
SUBAGENT_PROMPT_FIXED = "Search the corpus."
_QUESTION = re.compile(r"Find the documents that answer: (.*)\n")
_STEPS = re.compile(r"\[Steps: (\d+)/(\d+)\]")
_RETURNED = re.compile(r"<result>\s*<docs>(.*?)</docs>", re.DOTALL)  # a sub-agent's final message
_CHUNK = re.compile(r'<chunk id="([^"]+)">')


def draw(key: str, what: str) -> float:
    """A fixed number in [0, 1) per (task key, what)."""
    return fixed_draw(f"swarm-expert:{what}:{key}")


def parallel(options: SwarmOptions, task: TaskSpec) -> bool:
    """Whether the expert orchestrates this task in parallel."""
    if options.mode != "swarm":
        return False
    return draw(task.metadata.get("key", task.task_id), "parallel") < options.expert_parallel_rate


def item_task(parent: TaskSpec, item: Item) -> TaskSpec:
    """The search env's view of one item (targets and plan: what its expert reads)."""
    return TaskSpec(
        task_id=f"{parent.task_id}/{item.key}",
        env="search",
        prompt="",
        reference=" ".join(item.targets),
        seed=parent.seed,
        split=parent.split,
        metadata={
            "key": item.key,
            "question": item.question,
            "targets": " ".join(item.targets),
            "answer_docs": item.targets[-1],
            "queries": "|".join(item.queries),
        },
    )


def answer(ids: list[str], gap: str = " ") -> str:
    return f"<docs>{gap.join(dict.fromkeys(ids))}</docs>\n"


# The fixed layout's answer separates the ids by as many spaces as lie between two returned ids in
# the observation (`</docs></result>\n<result><docs>`), so each id is copied from one fixed distance.
FIXED_GAP = " " * len("</docs></result>\n<result><docs>")


def next_turn(options: SwarmOptions, search: Search, task: TaskSpec, context: str) -> str:
    """The orchestrator's or a sub-agent's next turn; `search` is the sub-agents' env (its expert)."""
    items = items_of(task.metadata)
    if HEADER not in context:
        m = _QUESTION.search(context)
        item = next((it for it in items if m is not None and it.question == m.group(1)), None)
        if item is None:
            return answer([])
        return search.expert(item_task(task, item), context)
    gap = FIXED_GAP if options.layout == "fixed" else " "
    if options.mode == "swarm" and options.expert_subagents == "per_item":
        return _per_item(options, task, items, context, gap)
    if parallel(options, task):
        if f'"name": "{ASSIGN}"' not in context:
            system = _subagent_prompt(options)
            line = call(CREATE, name=SUBAGENT_NAME, system_prompt=system)
            line += "".join(call(ASSIGN, agent=SUBAGENT_NAME, prompt=it.question) for it in items)
            return line + "\n"
        returned = [d for body in _RETURNED.findall(context) for d in body.split()]
        return answer(returned, FIXED_GAP if options.layout == "fixed" else " ")
    steps = _STEPS.findall(context)
    used, budget = (int(steps[-1][0]), int(steps[-1][1])) if steps else (0, options.budget(task.metadata))
    if used + 2 <= budget:
        for item in items:
            line = search.expert(item_task(task, item), context)
            if not line.startswith("<docs>"):
                return line
    if options.agenda and options.cite == "all":  # `*`: every document its calls returned
        return answer(["*"])
    seen = {doc_of(c) for c in _CHUNK.findall(context)}
    return answer([d for it in items for d in it.targets if d in seen])


def _subagent_prompt(options: SwarmOptions) -> str:
    return SUBAGENT_PROMPT if options.layout == "lines" else SUBAGENT_PROMPT_FIXED


def _per_item(options: SwarmOptions, task: TaskSpec, items: list[Item], context: str, gap: str) -> str:
    """The orchestrator's next turn with one sub-agent per item (see the module docstring)."""
    system = _subagent_prompt(options)
    done = context.count(f'"name": "{ASSIGN}"')
    returned = [d for body in _RETURNED.findall(context) for d in body.split()]
    if options.by_reference:  # the answer names the sub-agents; an assignment, the item's number
        returned, gap = (["*"] if options.cite == "all" else list(AGENT_NAMES[:done])), " "

    def task_of(item: Item) -> str:
        return str(items.index(item) + 1) if options.by_reference else item.question

    if parallel(options, task):
        if done:
            return answer(returned, gap)
        names = AGENT_NAMES[: len(items)]
        creates = [call(CREATE, name=n, system_prompt=system) for n in names]
        assigns = [call(ASSIGN, agent=n, prompt=task_of(it)) for n, it in zip(names, items, strict=True)]
        if options.by_reference:  # each sub-agent's pair, as a serial turn writes it, N in one turn
            return "".join(c + a for c, a in zip(creates, assigns, strict=True)) + "\n"
        return "".join(creates + assigns) + "\n"
    steps = _STEPS.findall(context)
    used, budget = (int(steps[-1][0]), int(steps[-1][1])) if steps else (0, options.budget(task.metadata))
    cost = -(-used // done) if done else 2 + options.wide_hops  # the turn's 1 + the sub-agent's hops + its answer
    if done < len(items) and used + cost + 1 <= budget:
        order = items[::-1] if options.expert_serial_order == "last_first" else items
        name, item = AGENT_NAMES[done], order[done]
        return call(CREATE, name=name, system_prompt=system) + call(ASSIGN, agent=name, prompt=task_of(item)) + "\n"
    return answer(returned, gap)
