"""The search tools: what the model sees, what travels to a backend, and the result text contract.

Two registries of the same four names:

- `model_tools()`: the schemas the model is shown and its calls are parsed against:
  search_corpus(query), grep_corpus(pattern), read_document(doc_id), prune_chunks(chunk_ids).
- `backend_tools(backend)`: search_corpus / grep_corpus / read_document with the hidden
  arguments the harness injects (`_exclude`: seen chunk ids; `_budget`: what the result may
  cost; `_query` for read_document: the task's question, for reranking). The model never sees
  them. A search tool-service serves tools of the same names and schemas; in-process, these run
  the `SearchBackend` directly. prune_chunks never leaves the harness: it edits the context.

Results are text: chunks rendered as `<chunk id="w0007#0">...</chunk>` blocks, best first
(`render_chunks`), which the harness parses back (`chunk_blocks`) to record seen ids, trim to the
budget and prune. Backends are built by name from the corpus (`register_backend`): the retrieval
lib registers its in-process hybrid backend; tests register small deterministic ones.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable, Sequence
from typing import Any

from slipstream.retrieval.types import Chunk, Document, SearchBackend, TokenCounter
from slipstream.toolcalls import Tool, ToolInputError, ToolRegistry

SEARCH, GREP, READ, PRUNE = "search_corpus", "grep_corpus", "read_document", "prune_chunks"
RETRIEVAL_TOOLS = (SEARCH, GREP, READ)
GREP_LIMIT = 5
NO_RESULTS = "no new chunks"

# The tool-service's blocks also carry doc= and title= attributes: the id is what the harness needs.
_BLOCK = re.compile(r'<chunk id="([^"]+)"[^>]*>(.*?)</chunk>', re.DOTALL)
_ID = {"type": "string", "pattern": r"^[A-Za-z0-9_.-]{1,64}$"}
_CHUNK_ID = {"type": "string", "pattern": r"^[A-Za-z0-9_.-]{1,64}#[0-9]{1,6}$"}

BackendFactory = Callable[[Sequence[Document], TokenCounter], SearchBackend]
BACKENDS: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make `factory(documents, count_tokens)` the backend named `name` (option `backend`)."""
    BACKENDS[name] = factory


def build_backend(name: str, documents: Sequence[Document], count_tokens: TokenCounter) -> SearchBackend:
    """The backend `name`: a registered name, or `"package.module:factory"`, imported here (so a
    tool-service replica or worker builds it without anything having registered it first)."""
    factory = BACKENDS.get(name)
    if factory is None and ":" in name:
        module, _, attr = name.partition(":")
        try:
            found: Any = functools.reduce(getattr, attr.split("."), importlib.import_module(module))
        except (ImportError, AttributeError) as exc:
            raise LookupError(f"search backend {name!r} cannot be imported: {exc}") from exc
        if not callable(found):
            raise LookupError(f"search backend {name!r} is not callable")
        factory = found
    if factory is None:
        known = ", ".join(sorted(BACKENDS)) or "(none registered)"
        raise LookupError(
            f"no search backend named {name!r}; registered: {known} (a backend registers itself with "
            "slipstream.envs.search.register_backend)"
        )
    return factory(documents, count_tokens)


def render_chunks(chunks: Sequence[Chunk]) -> str:
    """A tool result: chunk blocks best first, or `NO_RESULTS`."""
    if not chunks:
        return NO_RESULTS
    return "".join(f'<chunk id="{c.chunk_id}">{c.text}</chunk>' for c in chunks)


def chunk_blocks(text: str) -> list[tuple[str, str]]:
    """(chunk id, whole block text) of every chunk block in `text`, in order."""
    return [(m.group(1), m.group(0)) for m in _BLOCK.finditer(text)]


_DOCS = re.compile(r"<docs>(.*?)</docs>", re.DOTALL)


def parse_output(text: str, limit: int) -> list[str] | None:
    """The ranked doc ids of a final output `<docs>a b</docs>` (chunk ids name their document;
    deduplicated, at most `limit`); None when there is no `<docs>` list."""
    m = _DOCS.search(text)
    if m is None:
        return None
    ids = [doc_of(i) for i in re.split(r"[\s,]+", m.group(1).strip()) if i]
    return list(dict.fromkeys(ids))[:limit]


def doc_of(chunk_id: str) -> str:
    return chunk_id.rpartition("#")[0] or chunk_id


def _schema(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def model_tools() -> ToolRegistry:
    """The four tools as the model sees them (no implementations: the harness dispatches)."""
    return ToolRegistry(
        [
            Tool(SEARCH, "Hybrid search of the corpus.", _schema({"query": {"type": "string", "minLength": 1}})),
            Tool(
                GREP, "Chunks matching a regex (at most 5).", _schema({"pattern": {"type": "string", "minLength": 1}})
            ),
            Tool(READ, "A document's chunks.", _schema({"doc_id": _ID})),
            Tool(
                PRUNE,
                "Remove chunks from your context.",
                _schema({"chunk_ids": {"type": "array", "items": _CHUNK_ID, "minItems": 1, "maxItems": 64}}),
            ),
        ]
    )


_EXCLUDE = {"type": "array", "items": {"type": "string"}}
_BUDGET = {"type": "integer", "minimum": 0}


def backend_tools(backend: Callable[[], SearchBackend] | None, *, timeout_s: float = 10.0) -> ToolRegistry:
    """search/grep/read with their hidden arguments; `backend()` is called on first use (None: no
    implementation here, for a registry that only describes the wire schema of a tool-service).

    The hidden arguments are libs/toolcalls' (`_`-prefixed, never shown to the model, never required):
    `_exclude`, `_budget` and, for reads, `_query` — the same names and result format as the
    tool-service's `search` tool set, so a turn's calls run unchanged in-process or over NATS.
    """

    async def search(query: str, _exclude: list[str] | None = None, _budget: int = 0) -> str:
        assert backend is not None
        return render_chunks(await backend().search(query, exclude=_exclude or [], budget_tokens=_budget))

    async def grep(pattern: str, _exclude: list[str] | None = None, _budget: int = 0) -> str:
        assert backend is not None
        try:
            chunks = await backend().grep(pattern, exclude=_exclude or [], limit=GREP_LIMIT)
        except ValueError as exc:
            raise ToolInputError(f"bad regex {pattern!r}: {exc}") from None
        return render_chunks(chunks)

    async def read(doc_id: str, _exclude: list[str] | None = None, _budget: int = 0, _query: str = "") -> str:
        assert backend is not None
        try:
            chunks = await backend().read(doc_id, query=_query or None, exclude=_exclude or [], budget_tokens=_budget)
        except KeyError:
            raise ToolInputError(f"no document {doc_id!r}") from None
        return render_chunks(chunks)

    hidden = {"_exclude": _EXCLUDE, "_budget": _BUDGET}
    on = backend is not None

    def schema(visible: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {**visible, **extra},
            "required": list(visible),
            "additionalProperties": False,
        }

    return ToolRegistry(
        [
            Tool(SEARCH, "search", schema({"query": {"type": "string"}}, hidden), search if on else None, timeout_s),
            Tool(GREP, "grep", schema({"pattern": {"type": "string"}}, hidden), grep if on else None, timeout_s),
            Tool(
                READ,
                "read",
                schema({"doc_id": {"type": "string"}}, {**hidden, "_query": {"type": "string"}}),
                read if on else None,
                timeout_s,
            ),
        ]
    )
