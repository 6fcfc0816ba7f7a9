"""The `[service]` section every service config carries (owned by the runtime).

It holds what the runtime itself needs to start, serve probes and stop a service; each service's
own knobs live in its own section.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

Doc = msgspec.Meta


class ServiceSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    run_id: Annotated[str, Doc(description="Training run id; services of one run share it.")] = "dev"
    replica: Annotated[str, Doc(description="Replica id (defaults to host-pid at start).")] = ""
    http_host: Annotated[str, Doc(description="Bind address of /healthz, /readyz, /metrics.")] = "127.0.0.1"
    http_port: Annotated[
        int, Doc(description="Port of /healthz, /readyz, /metrics; 0 picks a free one.", ge=0, le=65535)
    ] = 0
    drain_timeout_s: Annotated[
        float, Doc(description="Budget to finish or hand back in-flight work on SIGTERM.", ge=0)
    ] = 20.0
    redis_url: Annotated[str, Doc(description="Redis URL for control-plane state; empty when unused.")] = ""
    stall_after_s: Annotated[
        float,
        Doc(
            description="Readiness fails, naming why, once work has been pending this long without progress "
            "(learner, rollout workers, task source); 0 = never.",
            ge=0,
        ),
    ] = 600.0
    port_file: Annotated[
        str,
        Doc(description="File the bound HTTP port is written to (for http_port=0 under a supervisor); empty = none."),
    ] = ""
