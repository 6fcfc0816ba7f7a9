"""The publisher: one staged version end to end — store it, announce it, remove the staged file.

Store first (in a thread: loading the safetensors file, hashing and uploading are blocking), and
announce only once `store_version` returned, that is once the manifest is committed after every
shard: a worker never sees an announce for a version it cannot fully fetch. The announce carries
msg_id `<run_id>:<version>`, so announcing again after a lost ack (or after a restart between
store and announce) is deduplicated by the stream within its window, and a worker ignores a
version it already holds after that. The staged file is removed last: a crash at any point leaves
the file, and the next attempt finishes the job.

With a control plane, the fence (`fence.py`) is asked right before the store and again right
before the announce: a version whose learner no longer leads the run is never announced.

With `parts` (a publisher per learner rank, `parts.py`), the store step stores this rank's part;
rank 0's returns the merged manifest once every part is in, and only rank 0 announces. Another
rank's publisher returns None from `publish` once rank 0 committed the version.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from slipstream.bus import Bus
from slipstream.bus.tracing import AttributeValue, annotate, extract, service_span, tracing_active
from slipstream.schemas import WeightAnnounce
from slipstream.schemas.subjects import WEIGHTS_ANNOUNCE
from slipstream.store import ObjectStore
from slipstream.telemetry.logs import get_logger
from slipstream.telemetry.metrics import counter, gauge, histogram
from slipstream.weight_publisher.codec import StoredVersion, VersionStore
from slipstream.weight_publisher.fence import Fence, Fenced, read_fence
from slipstream.weight_publisher.parts import PartPending, PartStore, VersionAbandoned
from slipstream.weights.staging import Staged, load_staged

log = get_logger(__name__)
TRACEPARENT = "traceparent"  # W3C trace context key the learner stages with the weights

SECONDS = histogram(
    "publisher/publish/seconds",
    "Seconds from picking up a staged version to its announce being acked.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
BYTES = counter("publisher/publish/bytes", "Bytes of shards uploaded to the object store.")
LATEST = gauge("publisher/publish/latest_version", "Newest policy version announced by this publisher.")
ANNOUNCED = counter("publisher/publish/announced", "Versions announced (label stored=new|existing).")
FAILURES = counter("publisher/publish/failures", "Attempts that failed and will be retried (label stage).")


def announce_msg_id(run_id: str, version: int) -> str:
    return f"{run_id}:{version}"


class VersionPublisher:
    """Stores and announces staged versions for one run."""

    def __init__(
        self,
        bus: Bus,
        store: ObjectStore,
        *,
        run_id: str,
        versions: VersionStore,
        delete_staged: bool,
        fence: Fence | None = None,
        parts: PartStore | None = None,
    ) -> None:
        self.bus = bus
        self.parts = parts
        self.fence = fence
        self.store = store
        self.run_id = run_id
        self.versions = versions
        self.delete_staged = delete_staged
        self.latest_version = -1

    async def publish(self, staged: Staged) -> StoredVersion | None:
        """Store, announce, clean up. Raises on failure; the staged file then stays for a retry.

        With a fence: `FenceWait` (retry later) or `Fenced` (the caller discards the file) before
        anything is stored or announced. With tracing on, all of it is one `weights.publish`
        span, child of the learner step that staged the version (its context is in the file's
        metadata; without one the span starts a trace of its own).
        """
        parent = extract(dict(staged.metadata)) if TRACEPARENT in staged.metadata and tracing_active() else None
        attributes: dict[str, AttributeValue] = {
            "slipstream.run_id": self.run_id,
            "slipstream.policy_version": staged.version,
        }
        with service_span("weights.publish", attributes, parent=parent, root=True):
            return await self._publish(staged)

    async def _publish(self, staged: Staged) -> StoredVersion | None:
        t0 = time.monotonic()
        staged_fence = None
        if self.fence is not None:
            try:
                staged_fence = await asyncio.to_thread(read_fence, staged.path)
            except ValueError as exc:
                raise Fenced(str(exc)) from exc  # cannot tell who staged it: fail closed
            await self.fence.admit(staged_fence, staged.version)
        store = self.versions.store_version if self.parts is None else self.parts.publish
        try:
            stored = await asyncio.to_thread(
                store,
                version=staged.version,
                load=lambda: load_staged(staged),
                step_finished_at=staged.step_finished_at,
                fence_token=0 if staged_fence is None else staged_fence.token,
            )
        except (PartPending, VersionAbandoned):
            raise  # not failures of this publisher: the version's other parts are late, or never came
        except Exception:
            FAILURES.add(1, stage="store")
            raise
        if stored is None:
            # Another rank's part, committed by rank 0 (which announces it): nothing more to do here.
            if self.delete_staged:
                Path(staged.path).unlink(missing_ok=True)
            self.latest_version = max(self.latest_version, staged.version)
            log.info("part committed", policy_version=staged.version, seconds=round(time.monotonic() - t0, 4))
            return None
        announce = WeightAnnounce(
            policy_version=stored.version,
            manifest_key=stored.manifest_key,
            base_version=stored.manifest.base_version,
            keyframe=stored.manifest.keyframe,
            run_id=self.run_id,
            step_finished_at=staged.step_finished_at,
            announced_at=time.time(),
            # The token the manifest was signed with: verifiers refuse an announce that claims another.
            # (A version committed before, by an earlier start, keeps the token it was stored under.)
            fence_token=stored.manifest.fence_token,
        )
        annotate(
            {
                "slipstream.keyframe": stored.manifest.keyframe,
                "slipstream.stored_bytes": stored.manifest.stored_bytes,
                "slipstream.already_stored": stored.already_stored,
            }
        )
        if self.fence is not None:
            # Again, as late as possible: the store may have taken long enough for the lease to move.
            await self.fence.admit(staged_fence, staged.version)
        try:
            await self.bus.publish(WEIGHTS_ANNOUNCE, announce, msg_id=announce_msg_id(self.run_id, stored.version))
        except Exception:
            FAILURES.add(1, stage="announce")
            raise
        if self.delete_staged:
            # A file already gone (removed by hand) is not an error: the version is announced.
            Path(staged.path).unlink(missing_ok=True)
        seconds = time.monotonic() - t0
        SECONDS.observe(seconds)
        ANNOUNCED.add(1, stored="existing" if stored.already_stored else "new")
        if not stored.already_stored:
            BYTES.add(stored.manifest.stored_bytes)
        self.latest_version = max(self.latest_version, stored.version)
        LATEST.set(self.latest_version)
        log.info(
            "announced",
            policy_version=stored.version,
            manifest_key=stored.manifest_key,
            stored_bytes=stored.manifest.stored_bytes,
            shards=len(stored.manifest.shards),
            already_stored=stored.already_stored,
            seconds=round(seconds, 4),
        )
        return stored
