"""Tool calls on the wire: what a caller sends a tool service and what a replica answers.

A tool with a shared, heavy backend (a search index, a sandbox pool) runs as the tool-service,
reached over NATS core request/reply on `tools.call.<tool>` with the queue group `tool-service`
(subjects.REQUESTS), so every replica takes a share and a dead one is simply not asked again.
Nothing here is stored in a stream: a request lives as long as its caller waits for it.

A caller may send the same `call_id` again (its first attempt timed out, or the replica died);
a replica that still remembers the call answers from memory (`replayed`) instead of running it
twice, and the caller keeps exactly one reply per call, whichever attempt it came from.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec

Doc = msgspec.Meta
ReplyStatus = Literal["ok", "invalid_tool_call", "infra_error"]


class ToolRequest(msgspec.Struct, kw_only=True):
    """One call of one tool, as a caller asks a tool service for it (traces ride in headers)."""

    SCHEMA: ClassVar[str] = "ToolRequest"
    VERSION: ClassVar[int] = 1

    call_id: Annotated[
        str, Doc(description="Unique per call within the run (episode, turn, index); the idempotency key.")
    ]
    tool: Annotated[str, Doc(description="Tool name; also the last token of the subject.")]
    arguments: Annotated[dict[str, Any], Doc(description="The call's arguments, already checked by the caller.")] = {}
    deadline: Annotated[
        float,
        Doc(description="Unix time after which the caller no longer waits; a replica skips a call past it. 0: none."),
    ] = 0.0
    attempt: Annotated[int, Doc(description="1 for the first send of this call_id, then 2, 3, ... on retries.")] = 1
    caller: Annotated[str, Doc(description="Who asks (e.g. the rollout worker's id), for logs.")] = ""


class ToolReply(msgspec.Struct, kw_only=True):
    """A replica's classified answer to one `ToolRequest`."""

    SCHEMA: ClassVar[str] = "ToolReply"
    VERSION: ClassVar[int] = 1

    call_id: Annotated[str, Doc(description="The request's call_id.")]
    tool: Annotated[str, Doc(description="The request's tool.")] = ""
    status: Annotated[
        ReplyStatus,
        Doc(
            description="'ok' (text is the result); 'invalid_tool_call' (the model's fault: text is the error shown "
            "to it); 'infra_error' (a timeout or a broken backend: never the model's fault)."
        ),
    ] = "ok"
    text: Annotated[
        str, Doc(description="The result (ok) or the error text (otherwise), as the model will see it.")
    ] = ""
    kind: Annotated[
        str, Doc(description="Why it failed: 'bad_arguments', 'unknown_tool', 'timeout', 'tool_crashed', ...")
    ] = ""
    elapsed_s: Annotated[float, Doc(description="Seconds the replica spent on the call.")] = 0.0
    served_by: Annotated[str, Doc(description="Replica id of the tool service that ran the call.")] = ""
    replayed: Annotated[
        bool, Doc(description="Answered from the replica's memory of this call_id, without running it again.")
    ] = False
