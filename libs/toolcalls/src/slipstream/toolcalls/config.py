"""The `[tools]` config fragment of a service that calls tools: where the calls run.

`transport = "local"` (the default) runs every tool in the calling process; `"nats"` sends each
call to the tool-service over NATS request/reply (`tools.call.<tool>`, queue group
`tool-service`), retrying on another replica when one does not answer.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

Doc = msgspec.Meta


class ToolsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    transport: Annotated[
        Literal["local", "nats"],
        Doc(description="'local': run tools in this process; 'nats': call the tool-service over request/reply."),
    ] = "local"
    url: Annotated[
        str, Doc(description="NATS server URL(s) of the tool-service, comma-separated; empty = the [bus] url.")
    ] = ""
    retries: Annotated[
        int,
        Doc(description="Re-sends of a call that got no reply (timeout, no responders), each to any replica.", ge=0),
    ] = 2
    reply_margin_s: Annotated[
        float,
        Doc(description="Seconds a caller waits past the tool's own timeout for a reply before it retries.", gt=0),
    ] = 1.0
    retry_backoff_s: Annotated[
        float,
        Doc(description="First pause before a retry (doubles each retry) so a restarting replica can join.", ge=0),
    ] = 0.1
    connect_timeout_s: Annotated[float, Doc(description="Timeout of one connection attempt.", gt=0)] = 5.0
