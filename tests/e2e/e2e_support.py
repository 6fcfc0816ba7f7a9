"""Small waits and probes the e2e tests share (they read what the services report on /readyz)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from slipstream.cli.status import read_json


async def until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `cond` every 0.2 s; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(0.2)


def worker_weights(port: int) -> dict[str, Any]:
    """A rollout worker's /readyz code, policy version and weights digest (`weights_sha256`)."""
    code, body = read_json(port, "/readyz", 1.0)
    st = (body or {}).get("status") or {}
    return {
        "code": code,
        "version": st.get("policy_version"),
        "digest": (st.get("weights") or {}).get("weights_sha256"),
    }
