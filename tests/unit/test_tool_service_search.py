"""The `search` tool set's options are checked before anything loads; a bad one fails naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.store import StoreConfig
from slipstream.tool_service.toolsets import ToolSetError, build_registry

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "needs option index"),
        ({"index": "/"}, "needs option index"),
        ({"index": "indexes/x", "colour": "red"}, r"has no option\(s\) \['colour'\]"),
        ({"index": "indexes/x", "search_tokens": -1}, "search_tokens must be an integer >= 0, got -1"),
        ({"index": "indexes/x", "threads": 0}, "threads must be an integer >= 1"),
        ({"index": "indexes/x", "timeout_s": "soon"}, "timeout_s must be a number > 0"),
        ({"index": "indexes/x", "store": {"type": "ftp"}}, "bad store option"),
    ],
)
def test_bad_search_options_fail_naming_the_option(options: dict[str, object], message: str) -> None:
    with pytest.raises(ToolSetError, match=message):
        build_registry(["search"], {"search": options})


def test_an_index_missing_from_the_replicas_store_is_named(tmp_path: Path) -> None:
    store = StoreConfig(type="local", root=str(tmp_path))
    with pytest.raises(ToolSetError, match=r"no index under .*indexes/absent.* \(no manifest\.json there\)"):
        build_registry(["search"], {"search": {"index": "indexes/absent"}}, store=store)
