"""The search tools answer the same in-process and from a tool-service replica serving the stored index.

One index (tests/search_corpus.py, the real MiniLM) is built into a local object store. The
in-process side is `HybridSearch` over the index loaded back from that store, behind
`LocalTransport`; the remote side is a real tool-service process serving the `search` tool set
(`index` = the key, `store` = the directory) on a real nats-server, behind `NatsTransport` with a
registry that has the tools' schemas and no implementation. Every call (with and without the
harness's hidden exclusion, budget and query; the model's errors) must come back identical:
outcome, kind and text. Only `served_by` differs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from search_corpus import stored_index
from tool_replicas import ToolReplica

from slipstream.retrieval.backend import HybridSearch
from slipstream.retrieval.dense import MiniLM
from slipstream.retrieval.index import load_index
from slipstream.retrieval.tools import chunk_ids_of, search_tools
from slipstream.stack import Server, start_nats
from slipstream.store import LocalObjectStore
from slipstream.toolcalls import LocalTransport, ToolCall, ToolRegistry, execute
from slipstream.toolcalls.remote import NatsTransport

# A replica loads torch, transformers and MiniLM before it is ready: tens of seconds on a busy 2-core machine.
pytestmark = [pytest.mark.contract, pytest.mark.timeout(400)]

BUDGETS = {"search_tokens": 30, "read_tokens": 40, "grep_tokens": 60}


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory, minilm: MiniLM) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("search-store")
    return root, stored_index(root, minilm)


@pytest.fixture(scope="module")
def nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("search-nats")
    srv = start_nats(root / "nats", root / "logs")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def replica(
    nats: Server, store_root: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ToolReplica]:
    root, key = store_root
    options = {"search": {"index": key, "store": {"type": "local", "root": str(root)}, **BUDGETS}}
    r = ToolReplica("search-0", nats.url, tmp_path_factory.mktemp("search-svc"), sets=["search"], options=options)
    try:
        yield r.wait_ready(timeout_s=300)
    finally:
        r.stop()


def calls() -> list[ToolCall]:
    stamp = time.monotonic_ns()

    def c(i: int, name: str, **arguments: object) -> ToolCall:
        return ToolCall(id=f"contract-{stamp}-{i}", name=name, arguments=arguments)

    return [
        c(0, "search_corpus", query="which river floods in spring"),
        c(1, "search_corpus", query="river barges", _budget=1000),
        c(2, "search_corpus", query="river barges", _budget=1000, _exclude=["river#0", "river#1", "rail#0"]),
        c(3, "search_corpus", query="court verdict", _budget=0),
        c(4, "grep_corpus", pattern=r"\bthe\b"),
        c(5, "grep_corpus", pattern="Halvor", _exclude=["space#0"]),
        c(6, "grep_corpus", pattern="(unclosed"),
        c(7, "read_document", doc_id="river"),
        c(8, "read_document", doc_id="river", _query="bridge crossing", _exclude=["river#0"], _budget=1000),
        c(9, "read_document", doc_id="nope"),
        c(10, "search_corpus", query=""),  # breaks the schema: the model's error on both sides
    ]


async def test_in_process_and_the_tool_service_answer_the_same(
    nats: Server, replica: ToolReplica, store_root: tuple[Path, str], minilm: MiniLM
) -> None:
    root, key = store_root
    backend = HybridSearch(load_index(LocalObjectStore(root), key), minilm)
    local = LocalTransport(ToolRegistry(search_tools(backend, titles=backend.index.titles(), **BUDGETS)))
    remote = await NatsTransport.connect(nats.url, ToolRegistry(search_tools(None, **BUDGETS)), name="search-caller")
    try:
        batch = calls()
        here = await execute(batch, local)
        there = await execute(batch, remote)
    finally:
        await remote.close()
    assert [(r.outcome, r.kind, r.text) for r in there] == [(r.outcome, r.kind, r.text) for r in here]
    # The suite is not vacuous: results, exclusion, empty budgets and the model's errors all occur.
    outcomes = [(r.outcome, r.kind) for r in here]
    assert outcomes.count(("ok", "")) == 8 and outcomes.count(("invalid_tool_call", "bad_arguments")) == 3
    assert chunk_ids_of(here[0].text) and not set(chunk_ids_of(here[2].text)) & {"river#0", "river#1", "rail#0"}
    assert here[3].text == "no new chunks found for 'court verdict'"
    assert {r.served_by for r in there if r.outcome == "ok"} == {replica.served_by}
    assert {r.served_by for r in here} == {"local"}


def test_a_replica_without_its_index_fails_to_start_naming_it(nats: Server, tmp_path: Path) -> None:
    options = {"search": {"index": "indexes/missing", "store": {"type": "local", "root": str(tmp_path / "empty")}}}
    r = ToolReplica("search-bad", nats.url, tmp_path, sets=["search"], options=options)
    try:
        with pytest.raises(RuntimeError, match="exited") as err:
            r.wait_ready(timeout_s=300)
    finally:
        r.stop()
    assert "no index under" in str(err.value) and "indexes/missing" in str(err.value)
