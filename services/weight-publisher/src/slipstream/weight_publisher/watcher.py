"""The staging watcher: which versions the learner has staged and this publisher has not published yet.

The learner writes `v<version>.safetensors` into the staging directory by temp file and rename,
so a listed file is complete. The watcher polls (a directory in the same pod: polling every few
tens of milliseconds costs nothing next to a training step) and hands back pending versions
oldest first. Versions published by this process are remembered, so with `delete_staged = false`
a kept file is not published twice.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from slipstream.weights.staging import Staged, list_staged


class StagingWatcher:
    def __init__(self, staging_dir: str | Path, poll_interval_s: float) -> None:
        self.staging_dir = Path(staging_dir)
        self.poll_interval_s = poll_interval_s
        self._done: set[int] = set()

    def pending(self) -> list[Staged]:
        """Staged versions not yet published by this process, oldest first."""
        return [s for s in list_staged(self.staging_dir) if s.version not in self._done]

    def mark_done(self, version: int) -> None:
        self._done.add(version)

    async def wait(self, stop: asyncio.Event) -> list[Staged]:
        """The pending versions as soon as there are any; an empty list once `stop` is set."""
        while not stop.is_set():
            found = await asyncio.to_thread(self.pending)
            if found:
                return found
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.poll_interval_s)
        return []
