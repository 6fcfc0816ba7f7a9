"""The tool-service's pure parts: which tools a replica serves, and its memory of call ids.

(Requests over a real nats-server: tests/contract/test_tools.py and tests/integration/test_tool_*.py.)
"""

from __future__ import annotations

import asyncio

import pytest

from slipstream.bus import BusConfig
from slipstream.envs import get_env
from slipstream.schemas import ToolReply
from slipstream.tool_service.config import ToolServeSection, ToolServiceConfig
from slipstream.tool_service.memory import CallMemory
from slipstream.tool_service.service import ToolService
from slipstream.tool_service.toolsets import ToolSetError, build_registry

pytestmark = pytest.mark.unit


def test_tool_sets_serve_builtins_and_the_tools_of_environments() -> None:
    reg = build_registry(["calc", "wait", "lookup"], {"wait": {"timeout_s": 0.5}, "lookup": {"salt": "x"}})
    assert reg.names == ("calculator", "wait", "get")
    assert reg.get("wait").timeout_s == 0.5  # type: ignore[union-attr]
    # The env's own tool, built with the given options: the same table as the workers' copy.
    assert reg.get("get").spec() == get_env("lookup", salt="x").registry.get("get").spec()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("sets", "options", "message"),
    [
        ([], {}, r"\[serve\] sets is empty"),
        (["nope"], {}, r"unknown tool set 'nope'; known: calc, wait, .*lookup.*sort"),
        # A plugin's env (examples/plugin-env, installed by make install) is known here too: it is
        # refused only because it has no tools, not as an unknown name.
        (["sort"], {}, r"environment 'sort' has no tools to serve"),
        (["arith"], {}, "environment 'arith' has no tools to serve"),
        (["calc", "calc"], {}, "tool 'calculator' is in both tool sets 'calc' and 'calc'"),
        (["calc"], {"lookup": {}}, r"options names tool sets that are not served: \['lookup'\]"),
        (["calc"], {"calc": {"precision": 3}}, r"takes only the option timeout_s, got \['precision'\]"),
        (["wait"], {"wait": {"timeout_s": 0}}, "timeout_s must be a number > 0, got 0"),
        (["lookup"], {"lookup": {"max_calls": 0}}, "tool set 'lookup': .*max_calls must be in 1..16, got 0"),
    ],
)
def test_a_bad_tool_set_is_refused_naming_what_is_wrong(sets: list[str], options: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ToolSetError, match=message):
        build_registry(sets, options)


def test_the_service_refuses_a_bus_without_request_reply_and_bad_sets_at_construction() -> None:
    with pytest.raises(ValueError, match="needs \\[bus\\] type = 'nats'"):
        ToolService(ToolServiceConfig(bus=BusConfig(type="memory")))
    with pytest.raises(ToolSetError, match="unknown tool set 'nope'"):
        ToolService(ToolServiceConfig(serve=ToolServeSection(sets=["nope"])))
    assert ToolService(ToolServiceConfig()).registry.names == ("calculator",)


async def test_call_memory_answers_a_call_id_once_and_forgets_the_oldest() -> None:
    memory = CallMemory(size=2, ttl_s=60)
    first, mine = memory.claim("a")
    again, mine_again = memory.claim("a")
    assert mine and not mine_again and again is first
    first.set_result(ToolReply(call_id="a", text="x"))
    assert (await again).text == "x"
    memory.claim("b")
    memory.claim("c")  # over the size: "a" is dropped
    assert len(memory) == 2 and memory.claim("a")[1]
    memory.forget("a")
    assert memory.claim("a")[1]


async def test_call_memory_expires_and_a_size_of_zero_remembers_nothing() -> None:
    memory = CallMemory(size=8, ttl_s=0.01)
    memory.claim("a")
    await asyncio.sleep(0.03)
    assert memory.claim("a")[1]
    none = CallMemory(size=0, ttl_s=60)
    assert none.claim("a")[1] and none.claim("a")[1] and len(none) == 0
