"""The orchestrator's tools: the two swarm tools and the direct search tools.

The swarm tools follow Kimi K2.5's Agent Swarm (techniques.md §2): `create_subagent(name,
system_prompt)` defines a sub-agent to reuse, `assign_task(agent, prompt)` runs one task on it;
several assign_task calls in one turn run at once, and each returns one message (the sub-agent's
final message) when its sub-agent is done. Both are dispatched by the environment (env.py),
never by a tool transport: there is nothing to run remotely, the spawn is the work. The direct
tools are the `search` env's retrieval tools (search_corpus, grep_corpus, read_document: the
same schemas, the same backend and transport), so a serial strategy exists; prune_chunks is the
sub-agents' (the orchestrator's context stays small: it holds questions and short answers).

In `single` mode the registry has the direct tools only: a call of a swarm tool is then an
unknown tool, shown to the model as the parser's error, like any other malformed call.
"""

from __future__ import annotations

from typing import Any

from slipstream.envs.search.tools import GREP, READ, SEARCH, model_tools
from slipstream.toolcalls import Tool, ToolRegistry

CREATE, ASSIGN = "create_subagent", "assign_task"
SWARM_TOOLS = (CREATE, ASSIGN)
DIRECT_TOOLS = (SEARCH, GREP, READ)

_NAME = {"type": "string", "pattern": r"^[A-Za-z0-9_-]{1,32}$"}
_TEXT = {"type": "string", "minLength": 1, "maxLength": 4000}


def _schema(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def swarm_tools() -> list[Tool]:
    return [
        Tool(
            CREATE,
            "Define a sub-agent under a name, with its own system prompt, to give tasks to later.",
            _schema({"name": _NAME, "system_prompt": _TEXT}),
        ),
        Tool(
            ASSIGN,
            "Give a task to a sub-agent you created: it works in its own context with the search tools and "
            "returns one message when done. Several agents may run at once; each call returns its agent's message.",
            _schema({"agent": _NAME, "prompt": _TEXT}),
        ),
    ]


def orchestrator_tools(mode: str) -> ToolRegistry:
    """What the orchestrator's calls are parsed against in `mode` ('swarm' or 'single')."""
    search = model_tools()
    direct = [t for name in DIRECT_TOOLS if (t := search.get(name)) is not None]
    return ToolRegistry([*direct, *swarm_tools()] if mode == "swarm" else direct)
