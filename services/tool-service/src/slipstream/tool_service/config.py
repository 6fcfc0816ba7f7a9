"""Configuration of the tool-service: one typed class on `ServiceConfig`.

`slipstream.runtime.base.ServiceConfig` holds the shared sections ([service], [bus], [store],
[telemetry]), each owned by its lib; this module adds the service's own.

Resolved by `slipstream.runtime.config` from defaults, a TOML file (`--config`),
`SLIPSTREAM_<SECTION>__<FIELD>` variables and `--section.field` flags, in that order. Only
`[bus] url` and the connection timeouts of `[bus]` are used: requests are core NATS, no stream.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import msgspec

from slipstream.runtime.base import ServiceConfig

Doc = msgspec.Meta


class ToolServeSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`[serve]`: which tools this replica answers, how many calls it runs at once, what it remembers.

    Not `[tools]`: that is the callers' section (`ToolsConfig`, where their calls go), and one
    shared environment (the cluster's `slipstream-env`) may carry both.
    """

    sets: Annotated[
        list[str],
        Doc(
            description=(
                "Tool sets to serve: 'calc' (calculator), 'wait' (a slow echo for tests), 'search' (search_corpus, "
                "grep_corpus, read_document over a stored hybrid index: options index, store, budgets), or the "
                "name of an environment with tools (e.g. 'lookup': its 'get')."
            )
        ),
    ] = msgspec.field(default_factory=lambda: ["calc"])
    options: Annotated[
        dict[str, dict[str, Any]],
        Doc(
            description=(
                "Options per tool set, {set: {option: value}}: an environment's options (keep them equal to the "
                "workers' [worker] env_options: the lookup table's salt lives there), or timeout_s for calc/wait."
            )
        ),
    ] = {}
    concurrency: Annotated[int, Doc(description="Calls this replica runs at once; the rest wait in order.", ge=1)] = 64
    remember_calls: Annotated[
        int, Doc(description="Recent call ids (and replies) kept so a retried call is answered, not re-run.", ge=0)
    ] = 8192
    remember_s: Annotated[float, Doc(description="How long a call id is remembered.", gt=0)] = 300.0


class ToolServiceConfig(ServiceConfig, kw_only=True, forbid_unknown_fields=True):
    section_docs: ClassVar[dict[str, str]] = {
        "bus": "NATS server (type must be 'nats'; only url and timeouts are used).",
        "store": "Object store the 'search' tool set loads its index from (unless its options name one).",
    }
    serve: Annotated[ToolServeSection, Doc(description="The tools served, concurrency and call-id memory.")] = (
        msgspec.field(default_factory=ToolServeSection)
    )
