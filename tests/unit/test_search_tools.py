"""The search tools over a real (tiny) hybrid index: hidden arguments, exclusion, budgets, grep, read.

The index is built with the real all-MiniLM-L6-v2 (the session's `minilm` fixture) over six
short documents written so that each question has one right document (tests/search_corpus.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from search_corpus import DOCS, PARAMS

from slipstream.retrieval.backend import HybridSearch
from slipstream.retrieval.index import build_index, corpus_key, load_index, save_index
from slipstream.retrieval.tools import chunk_ids_of, search_tools
from slipstream.store import LocalObjectStore
from slipstream.toolcalls import LocalTransport, ToolCall, ToolRegistry, renderer_for, with_hidden
from slipstream.toolcalls.calls import MalformedCall

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def backend(minilm: object) -> HybridSearch:
    index = build_index(DOCS, minilm, PARAMS)  # type: ignore[arg-type]
    return HybridSearch(index, minilm)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def registry(backend: HybridSearch) -> ToolRegistry:
    return ToolRegistry(search_tools(backend, titles={d.doc_id: d.title for d in DOCS}, search_tokens=30))


def run(registry: ToolRegistry, name: str, **arguments: object) -> tuple[str, str, str]:
    result = asyncio.run(LocalTransport(registry).invoke(ToolCall(id="c", name=name, arguments=arguments)))
    return result.outcome, result.kind, result.text


# --------------------------------------------------------------------------- hidden arguments


def test_hidden_arguments_are_never_shown_to_the_model(registry: ToolRegistry) -> None:
    shown = {s["function"]["name"]: s["function"]["parameters"] for s in registry.specs()}
    assert {name: sorted(p["properties"]) for name, p in shown.items()} == {
        "search_corpus": ["query"],
        "grep_corpus": ["pattern"],
        "read_document": ["doc_id"],
    }
    preamble = renderer_for("tags").render([], tools=registry)
    assert "_exclude" not in preamble and "_budget" not in preamble and "search_corpus" in preamble
    # ... but the full schema (what the replica validates) has them.
    assert registry.get("read_document").hidden == ("_exclude", "_budget", "_query")  # type: ignore[union-attr]


def test_a_model_that_writes_a_hidden_argument_makes_a_malformed_call(registry: ToolRegistry) -> None:
    r = renderer_for("tags")
    turn = r.parse('<tool>{"name": "search_corpus", "args": {"query": "salt", "_exclude": []}}</tool>', registry)
    [item] = turn.items
    assert isinstance(item, MalformedCall) and item.kind == "bad_arguments"
    assert item.error == "error: invalid arguments for search_corpus: unexpected argument(s) '_exclude'"


def test_with_hidden_replaces_what_the_call_carried_and_keeps_only_declared_names(registry: ToolRegistry) -> None:
    call = ToolCall(id="1", name="search_corpus", arguments={"query": "salt", "_budget": 10**9})
    tool = registry.get("search_corpus")
    assert tool is not None
    out = with_hidden(call, {"_exclude": ["chem#0"], "_budget": 5, "_query": "q"}, accepts=tool.hidden)
    assert dict(out.arguments) == {"query": "salt", "_exclude": ["chem#0"], "_budget": 5}
    with pytest.raises(ValueError, match="must start with '_'"):
        with_hidden(call, {"budget": 5})


# --------------------------------------------------------------------------- search: relevance, exclusion, budget


def test_search_finds_the_right_document_first(registry: ToolRegistry) -> None:
    for query, doc in [
        ("which river floods in spring", "river"),
        ("salt crystal sodium", "chem"),
        ("comet tail", "space"),
    ]:
        outcome, _, text = run(registry, "search_corpus", query=query, _budget=1000)
        assert outcome == "ok"
        assert chunk_ids_of(text)[0].split("#")[0] == doc, (query, text)


def test_seen_chunks_are_never_returned_again(registry: ToolRegistry, backend: HybridSearch) -> None:
    _, _, first = run(registry, "search_corpus", query="river barges bridge", _budget=1000)
    seen = chunk_ids_of(first)
    assert len(seen) > 3
    _, _, again = run(registry, "search_corpus", query="river barges bridge", _budget=1000, _exclude=seen[:3])
    assert chunk_ids_of(again) == seen[3:]  # the rest, in the same order
    everything = [c.chunk_id for c in backend.index.chunks]
    outcome, _, none_left = run(registry, "search_corpus", query="river", _exclude=everything)
    assert (outcome, none_left) == ("ok", "no new chunks found for 'river'")


def test_search_is_cut_to_the_budget_in_whole_chunks(registry: ToolRegistry, backend: HybridSearch) -> None:
    tokens = {c.chunk_id: c.tokens for c in backend.index.chunks}
    _, _, full = run(registry, "search_corpus", query="comet", _budget=1000)
    ids = chunk_ids_of(full)
    budget = tokens[ids[0]] + tokens[ids[1]]
    _, _, cut = run(registry, "search_corpus", query="comet", _budget=budget)
    got = chunk_ids_of(cut)
    assert got[:2] == ids[:2] and sum(tokens[c] for c in got) <= budget
    assert run(registry, "search_corpus", query="comet", _budget=0)[2] == "no new chunks found for 'comet'"
    # No _budget: the tool's default (30 here).
    assert sum(tokens[c] for c in chunk_ids_of(run(registry, "search_corpus", query="comet")[2])) <= 30


# --------------------------------------------------------------------------- grep


def test_grep_returns_at_most_five_chunks_most_matches_first(registry: ToolRegistry, backend: HybridSearch) -> None:
    outcome, _, text = run(registry, "grep_corpus", pattern=r"\bthe\b", _budget=10_000)
    ids = chunk_ids_of(text)
    assert outcome == "ok" and len(ids) == 5
    many = sum(1 for c in backend.index.chunks if "the " in f"{backend.index.title(c.doc_id)}\n{c.text}".lower())
    assert many > 5  # the limit, not the corpus, made it five
    _, _, two = run(registry, "grep_corpus", pattern=r"Comet|Halvor")
    # space#0 has "Comet" in its title and "Comet Halvor" in its text (4 matches); space#1 only the title's 2.
    assert chunk_ids_of(two) == ["space#0", "space#1"]
    assert chunk_ids_of(run(registry, "grep_corpus", pattern="Halvor", _exclude=["space#0"])[2]) == ["space#1"]


def test_a_bad_regex_is_the_models_error_naming_the_pattern(registry: ToolRegistry) -> None:
    outcome, kind, text = run(registry, "grep_corpus", pattern="(unclosed")
    assert (outcome, kind) == ("invalid_tool_call", "bad_arguments")
    assert text.startswith("error: invalid arguments for grep_corpus: bad regular expression '(unclosed'")


# --------------------------------------------------------------------------- read


def test_read_document_ranks_its_chunks_against_the_hidden_query_and_cuts_to_budget(
    registry: ToolRegistry, backend: HybridSearch
) -> None:
    _, _, plain = run(registry, "read_document", doc_id="river")
    assert chunk_ids_of(plain) == [f"river#{n}" for n in range(backend.index.docs["river"].count)]
    _, _, ranked = run(registry, "read_document", doc_id="river", _query="bridge crossing")
    [bridge] = [c.chunk_id for c in backend.index.chunks if "bridge" in c.text]
    assert chunk_ids_of(ranked)[0] == bridge != chunk_ids_of(plain)[0]
    _, _, rest = run(registry, "read_document", doc_id="river", _exclude=["river#0"], _budget=1000)
    assert "river#0" not in chunk_ids_of(rest)
    outcome, kind, text = run(registry, "read_document", doc_id="nope")
    assert (outcome, kind) == ("invalid_tool_call", "bad_arguments") and "no document 'nope'" in text


# --------------------------------------------------------------------------- the stored index


def test_an_index_saved_to_the_store_loads_equal_and_a_corrupt_file_is_refused(
    backend: HybridSearch, minilm: object, tmp_path: Path
) -> None:
    store = LocalObjectStore(tmp_path)
    key = corpus_key(DOCS, backend.index.params)
    save_index(store, key, backend.index)
    loaded = HybridSearch(load_index(store, key), minilm)  # type: ignore[arg-type]
    a = asyncio.run(backend.search("grain harbour", exclude=(), budget_tokens=100))
    b = asyncio.run(loaded.search("grain harbour", exclude=(), budget_tokens=100))
    assert a == b and a
    assert key != corpus_key(DOCS[:-1], backend.index.params)
    store.put(f"{key}/dense.npy", store.get(f"{key}/dense.npy")[:-4] + b"\0\0\0\0")
    with pytest.raises(ValueError, match=r"dense\.npy does not match its sha256"):
        load_index(store, key)


def test_a_tool_cannot_require_a_hidden_argument() -> None:
    from slipstream.toolcalls import Tool, ToolDefinitionError

    schema = {"type": "object", "properties": {"q": {"type": "string"}, "_n": {"type": "integer"}}, "required": ["_n"]}
    with pytest.raises(ToolDefinitionError, match=r"hidden arguments \['_n'\] cannot be required"):
        Tool(name="t", description="", parameters=schema)
