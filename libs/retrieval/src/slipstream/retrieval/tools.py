"""The search tools the model calls: search_corpus, grep_corpus, read_document.

Each is a `slipstream.toolcalls.Tool` over a `SearchBackend`, so the same objects run in-process
(`LocalTransport`) and in a tool-service replica (the `search` tool set). What the model is
shown is one argument each (`query`, `pattern`, `doc_id`). The harness adds hidden arguments
(names starting with `_`, stripped from the schema the model sees; see slipstream.toolcalls.tool):

| hidden      | tools                      | meaning                                                       |
|-------------|----------------------------|---------------------------------------------------------------|
| `_exclude`  | all three                  | chunk ids already seen this episode: never returned again     |
| `_budget`   | all three                  | tokens this result may hold (whole chunks, best first)        |
| `_query`    | read_document              | what to rank the document's chunks against (e.g. the task)   |

The harness sets them after parsing a turn, per call:
`with_hidden(call, {"_exclude": sorted(seen), "_budget": n, "_query": q}, accepts=tool.hidden)`.
Absent, `_exclude` is empty and `_budget` is the tool's default (`search_tokens`,
`read_tokens`, `grep_tokens`). The budget counts chunk text tokens (`Chunk.tokens`); the few
tokens of each chunk's tag are not counted.

A result is the chunks, best first, one tag each:
`<chunk id="doc-7#2" doc="doc-7" title="...">text</chunk>`; `chunk_ids_of(text)` gives the ids
back to the harness (to extend its seen set and to know what a prune may name). An empty result
says so in words. A bad regex or an unknown document id is the model's error (`bad_arguments`).
"""

from __future__ import annotations

import html
import re
from typing import Any

from slipstream.retrieval.ranking import cut_to_budget
from slipstream.retrieval.types import Chunk, SearchBackend
from slipstream.toolcalls import Tool, ToolInputError

GREP_LIMIT = 5
_CHUNK_TAG = re.compile(r'<chunk id="([^"]+)"')


def render_chunks(chunks: list[Chunk], titles: dict[str, str] | None = None) -> str:
    titles = titles or {}
    out = []
    for c in chunks:
        title = titles.get(c.doc_id, "")
        attrs = f'id="{c.chunk_id}" doc="{c.doc_id}"' + (f' title="{html.escape(title)}"' if title else "")
        out.append(f"<chunk {attrs}>{c.text}</chunk>")
    return "\n".join(out)


def chunk_ids_of(text: str) -> list[str]:
    """The chunk ids a search tool's result holds, in order."""
    return _CHUNK_TAG.findall(text)


def _hidden_schema(*, query: bool = False) -> dict[str, Any]:
    props: dict[str, Any] = {
        "_exclude": {"type": "array", "items": {"type": "string"}, "description": "seen chunk ids (harness)"},
        "_budget": {"type": "integer", "minimum": 0, "description": "tokens this result may hold (harness)"},
    }
    if query:
        props["_query"] = {"type": "string", "description": "what to rank the chunks against (harness)"}
    return props


def search_tools(
    backend: SearchBackend | None,
    *,
    titles: dict[str, str] | None = None,
    search_tokens: int = 2000,
    read_tokens: int = 4000,
    grep_tokens: int = 4000,
    timeout_s: float = 10.0,
) -> list[Tool]:
    """search_corpus, grep_corpus and read_document over `backend`; `titles` (doc id -> title) label results.

    With `backend=None` the tools have no implementation: the registry a caller holds when the
    tools run in a tool service (it validates calls and describes the tools; the replica runs them).
    """
    for name, value in (("search_tokens", search_tokens), ("read_tokens", read_tokens), ("grep_tokens", grep_tokens)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")

    async def search_corpus(query: str, _exclude: list[str] | None = None, _budget: int | None = None) -> str:
        assert backend is not None
        budget = search_tokens if _budget is None else _budget
        chunks = await backend.search(query, exclude=_exclude or (), budget_tokens=budget)
        return render_chunks(chunks, titles) if chunks else f"no new chunks found for {query!r}"

    async def grep_corpus(pattern: str, _exclude: list[str] | None = None, _budget: int | None = None) -> str:
        assert backend is not None
        budget = grep_tokens if _budget is None else _budget
        try:
            chunks = await backend.grep(pattern, exclude=_exclude or (), limit=GREP_LIMIT)
        except ValueError as exc:
            raise ToolInputError(str(exc)) from None
        # grep has no ranking of its own to trade off against the budget: most matches first, cut.
        kept = cut_to_budget(chunks, budget)
        return render_chunks(kept, titles) if kept else f"no new chunk matches {pattern!r}"

    async def read_document(
        doc_id: str, _exclude: list[str] | None = None, _budget: int | None = None, _query: str | None = None
    ) -> str:
        assert backend is not None
        budget = read_tokens if _budget is None else _budget
        try:
            chunks = await backend.read(doc_id, query=_query or None, exclude=_exclude or (), budget_tokens=budget)
        except KeyError:
            raise ToolInputError(f"no document {doc_id!r}; use a doc id from a search result") from None
        return render_chunks(chunks, titles) if chunks else f"document {doc_id!r} has no unseen chunk that fits"

    return [
        Tool(
            name="search_corpus",
            description=(
                "Search the corpus by keywords and meaning. Returns the most relevant chunks you have not "
                "seen yet, each tagged with its chunk id and document id."
            ),
            parameters={
                "type": "object",
                "properties": {"query": {"type": "string", "minLength": 1, "maxLength": 1000}, **_hidden_schema()},
                "required": ["query"],
                "additionalProperties": False,
            },
            fn=search_corpus if backend is not None else None,
            timeout_s=timeout_s,
        ),
        Tool(
            name="grep_corpus",
            description=(
                f"Find chunks whose text matches a regular expression (at most {GREP_LIMIT}, unseen ones only, "
                "most matches first)."
            ),
            parameters={
                "type": "object",
                "properties": {"pattern": {"type": "string", "minLength": 1, "maxLength": 500}, **_hidden_schema()},
                "required": ["pattern"],
                "additionalProperties": False,
            },
            fn=grep_corpus if backend is not None else None,
            timeout_s=timeout_s,
        ),
        Tool(
            name="read_document",
            description=(
                "Read a document by its id: its chunks you have not seen yet, most relevant first, as many as "
                "fit in the remaining budget."
            ),
            parameters={
                "type": "object",
                "properties": {
                    "doc_id": {"type": "string", "minLength": 1, "maxLength": 200},
                    **_hidden_schema(query=True),
                },
                "required": ["doc_id"],
                "additionalProperties": False,
            },
            fn=read_document if backend is not None else None,
            timeout_s=timeout_s,
        ),
    ]
