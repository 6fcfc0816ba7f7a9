"""`Control`: one run's control plane (lease, ledger, task statistics, eval history) on one connection.

Services build it from `[service] redis_url` and `run_id` with `connect_control`, and show
`readiness()` on /readyz: while Redis is down every operation raises `ControlUnavailable`
within the timeout and the service reports "degraded"; the next operation after Redis is back
succeeds and the flag clears by itself.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from slipstream.control.client import ControlClient, ControlUnavailable
from slipstream.control.eval_history import EvalHistory
from slipstream.control.keyspace import Keyspace
from slipstream.control.lease import LeaderLease
from slipstream.control.ledger import DEFAULT_TTL_S, Ledger
from slipstream.control.task_stats import TaskStats


class Control:
    """The control-plane state of one run."""

    def __init__(self, client: ControlClient, run_id: str, *, ledger_ttl_s: float = DEFAULT_TTL_S) -> None:
        self.client = client
        self.run_id = run_id
        self.keys = Keyspace(run_id)
        self.ledger = Ledger(client, run_id, ttl_s=ledger_ttl_s)
        self.task_stats = TaskStats(client, run_id)
        self.evals = EvalHistory(client, run_id)

    def lease(self, holder_id: str | None = None, ttl_s: float = 10.0) -> LeaderLease:
        """The learner's leader lease, as `holder_id` (default: host:pid:random) would hold it."""
        return LeaderLease(self.client, self.run_id, holder_id, ttl_s)

    async def granted_fence(self) -> int | None:
        """The highest fencing token the run's lease has ever granted (the counter every acquisition
        increments), or None when Redis holds no counter (a fresh run, or Redis restarted empty).

        A version announced under a higher token was never staged by a learner that held the lease.
        """
        raw = await self.client.call("lease.granted", lambda r: r.get(self.keys.fence))
        if raw is None:
            return None
        text = str(raw)
        return int(text) if text.isdigit() else None

    @property
    def healthy(self) -> bool:
        """False while the last operation could not reach Redis."""
        return self.client.healthy

    def readiness(self) -> dict[str, Any]:
        """The /readyz fragment: {"redis": "ok" | "degraded", "url": ..., "error": ...}."""
        body: dict[str, Any] = {"redis": "ok" if self.client.healthy else "degraded", "url": self.client.url}
        if self.client.last_error is not None:
            body["error"] = self.client.last_error
        return body

    async def ping(self) -> bool:
        """Probe Redis (e.g. from a readiness loop); returns `healthy` instead of raising."""
        try:
            await self.client.ping()
        except ControlUnavailable:
            # Already counted and logged by the client; the flag is the answer.
            return False
        return True

    async def close(self) -> None:
        await self.client.close()

    async def __aenter__(self) -> Control:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


async def connect_control(
    url: str, run_id: str, *, timeout_s: float = 2.0, ledger_ttl_s: float = DEFAULT_TTL_S
) -> Control:
    """Connect and ping once; raises `ControlUnavailable` (naming the URL) when Redis is not there."""
    if not url:
        raise ValueError("control plane needs a Redis URL ([service] redis_url / SLIPSTREAM_SERVICE__REDIS_URL)")
    control = Control(ControlClient(url, timeout_s=timeout_s), run_id, ledger_ttl_s=ledger_ttl_s)
    try:
        await control.client.ping()
    except BaseException:
        await control.close()
        raise
    return control
