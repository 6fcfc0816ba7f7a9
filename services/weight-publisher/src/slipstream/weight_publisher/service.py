"""The weight-publisher service: stores each version the learner stages and announces it on weights.announce.

    staging dir (v<version>.safetensors, from the learner) --watcher--> publisher --> object store
                                                                                  --> weights.announce

One publisher runs beside each learner rank. Versions are published in order, one at a time; a
version whose store or announce fails is retried (with a growing pause) before any later one, so
announces never go backwards. On SIGTERM the version in flight is finished (manifest last, then
the announce) and what is already staged gets one attempt each; a version cut short leaves no
manifest and no announce, and its staged file is published by the next start.

With `[service] redis_url`, every version passes the fence (`fence.py`): it is published only
while the learner that staged it leads the run. A fenced version's staged file is discarded
(renamed `*.fenced` when `delete_staged` is false); while the fence cannot decide (Redis away,
lease vacant) the version waits and is retried, and `/readyz` shows the control plane degraded.

With `[trust] signing_key`, every manifest is signed (ed25519) before it is committed; `status()`
names the key id, which verifiers must list in their `[trust] trusted_keys`.

With `[publisher] ranks` > 1 this is one of N publishers, one per learner rank (`parts.py`): it
watches `<staging_dir>/rank-<rank>` and stores that rank's part of each version; rank 0 commits
the manifest naming every part and announces it, or abandons a version whose parts do not all
arrive within `part_timeout_s` (never announced; the staged part is dropped and counted).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream.bus import connect_bus
from slipstream.control import Control, ControlClient
from slipstream.runtime.backoff import Backoff
from slipstream.runtime.service import BaseService
from slipstream.store import setup_store
from slipstream.telemetry.logs import get_logger
from slipstream.trust import SigningKey, load_signing_key
from slipstream.weight_publisher.codec import VersionStore
from slipstream.weight_publisher.config import WeightPublisherConfig
from slipstream.weight_publisher.fence import Fence, Fenced, FenceWait
from slipstream.weight_publisher.parts import PartPending, PartStore, VersionAbandoned
from slipstream.weight_publisher.publisher import VersionPublisher
from slipstream.weight_publisher.watcher import StagingWatcher
from slipstream.weights.staging import rank_staging_dir

if TYPE_CHECKING:
    from slipstream.bus import Bus
    from slipstream.store import ObjectStore
    from slipstream.weights.staging import Staged

log = get_logger(__name__)
PROBE_INTERVAL_S = 2.0


class WeightPublisherService(BaseService):
    name = "weight-publisher"

    def __init__(self, cfg: WeightPublisherConfig) -> None:
        self.cfg = cfg
        self.bus: Bus | None = None
        self.store: ObjectStore | None = None
        self.publisher: VersionPublisher | None = None
        p = cfg.publisher
        self.watcher = StagingWatcher(rank_staging_dir(p.staging_dir, p.rank, p.ranks), p.poll_interval_s)
        self._pending = 0
        self.published = 0
        self.fenced = 0
        self.abandoned = 0
        self.parts: PartStore | None = None
        self.control: Control | None = None
        self._waiting: tuple[int, str] | None = None  # the version the fence holds back, and why (logged once)
        self.signing_key: SigningKey | None = None

    async def setup(self) -> None:
        if self.cfg.trust.signing_key:
            self.signing_key = load_signing_key(self.cfg.trust.signing_key)  # BadKey names the file: fatal
            log.info("signing manifests", key_id=self.signing_key.key_id, public_key=self.signing_key.public)
        else:
            log.warning("no [trust] signing_key: manifests are not signed; verifiers with trusted keys refuse them")
        self.store = await asyncio.to_thread(setup_store, self.cfg.store)
        self.bus = await connect_bus(self.cfg.bus, name=f"{self.name}/{self.cfg.service.replica}")
        await self.bus.ensure_streams()
        fence = None
        if self.cfg.service.redis_url:
            # No ping: a publisher started while Redis is down waits at the fence, it does not fail.
            p = self.cfg.publisher
            client = ControlClient(self.cfg.service.redis_url, timeout_s=p.control_timeout_s)
            self.control = Control(client, self.cfg.service.run_id)
            fence = Fence(self.control, min_remaining_s=p.fence_min_remaining_s)
        p = self.cfg.publisher
        if p.ranks > 1:
            self.parts = PartStore(
                self.store,
                run_id=self.cfg.service.run_id,
                rank=p.rank,
                ranks=p.ranks,
                part_timeout_s=p.part_timeout_s,
                poll_s=p.poll_interval_s,
                shard_bytes=p.shard_bytes,
                keyframe_every=p.keyframe_every,
                zstd_level=p.zstd_level,
                threads=p.codec_threads,
                signing_key=self.signing_key,
            )
        self.publisher = VersionPublisher(
            self.bus,
            self.store,
            run_id=self.cfg.service.run_id,
            versions=VersionStore(
                self.store,
                run_id=self.cfg.service.run_id,
                shard_bytes=self.cfg.publisher.shard_bytes,
                codec=self.cfg.publisher.codec,
                keyframe_every=self.cfg.publisher.keyframe_every,
                zstd_level=self.cfg.publisher.zstd_level,
                threads=self.cfg.publisher.codec_threads,
                signing_key=self.signing_key,
            ),
            delete_staged=self.cfg.publisher.delete_staged,
            fence=fence,
            parts=self.parts,
        )
        log.info(
            "watching",
            staging_dir=str(self.watcher.staging_dir),
            run_id=self.cfg.service.run_id,
            rank=p.rank,
            ranks=p.ranks,
        )

    async def run(self, stop: asyncio.Event) -> None:
        if self.parts is not None:
            self.parts.stopping = stop.is_set  # a wait for the other ranks' parts ends at a stop
        probe = asyncio.create_task(self._probe(stop), name="publisher.probe") if self.control is not None else None
        try:
            await self._publish_loop(stop)
        finally:
            if probe is not None:
                probe.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await probe

    async def _probe(self, stop: asyncio.Event) -> None:
        """Ping Redis now and then, so /readyz shows the control plane's state even with nothing to publish."""
        assert self.control is not None
        while not stop.is_set():
            await self.control.ping()  # returns the health flag; failures are counted by the client
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), PROBE_INTERVAL_S)

    async def _publish_loop(self, stop: asyncio.Event) -> None:
        retry = Backoff(self.cfg.publisher.poll_interval_s, max_s=self.cfg.publisher.retry_max_s)
        while not stop.is_set():
            batch = await self.watcher.wait(stop)
            self._pending = len(batch)
            for staged in batch:
                if not await self._attempt(staged):
                    # Retry this (the oldest) version before any later one; the rescan picks it up first.
                    await retry.sleep(stop)
                    break
                retry.reset()
                if stop.is_set():
                    break
        # Stopping: what the learner already staged gets one attempt each, within the drain budget.
        leftover = await asyncio.to_thread(self.watcher.pending)
        self._pending = len(leftover)
        for staged in leftover:
            if not await self._attempt(staged):
                break

    async def _attempt(self, staged: Staged) -> bool:
        assert self.publisher is not None, "setup() was not run"
        try:
            await self.publisher.publish(staged)
        except FenceWait as exc:
            if self._waiting != (staged.version, str(exc)):
                self._waiting = (staged.version, str(exc))
                log.warning("version held back by the fence; retrying", policy_version=staged.version, reason=str(exc))
            return False
        except Fenced as exc:
            self._discard(staged)
            self._waiting = None
            self.fenced += 1
            log.error(
                "staged version fenced: discarded, never announced", policy_version=staged.version, reason=str(exc)
            )
            return True
        except VersionAbandoned as exc:
            # Rank 0 gave up on this version (a part missing or not fitting): never announced, by anyone.
            self._discard(staged)
            self._waiting = None
            self.abandoned += 1
            log.error("version abandoned: never announced", policy_version=staged.version, reason=str(exc))
            return True
        except PartPending as exc:
            if self._waiting != (staged.version, str(exc)):
                self._waiting = (staged.version, str(exc))
                log.info("waiting for the version's other parts; retrying", policy_version=staged.version)
            return False
        except FileNotFoundError:
            # Removed while we worked on it (by hand, or a second publisher on the same directory).
            log.warning("staged version vanished", policy_version=staged.version, path=str(staged.path))
            self.watcher.mark_done(staged.version)
            return True
        except Exception as exc:
            # Store or bus trouble (S3 down, NATS reconnecting): reported and retried by `run`.
            log.warning("publish failed; retrying", policy_version=staged.version, error=repr(exc), exc_info=True)
            return False
        self.watcher.mark_done(staged.version)
        self._waiting = None
        self.published += 1
        self._pending = max(0, self._pending - 1)
        return True

    def _discard(self, staged: Staged) -> None:
        path = Path(staged.path)
        if self.cfg.publisher.delete_staged:
            path.unlink(missing_ok=True)
        elif path.exists():
            path.rename(path.with_name(path.name + ".fenced"))  # kept for a post-mortem, ignored by the watcher
        self.watcher.mark_done(staged.version)

    async def close(self) -> None:
        if self.control is not None:
            await self.control.close()
        if self.bus is not None:
            await self.bus.close()
        if self.store is not None:
            self.store.close()

    def ready(self) -> bool:
        return self.bus is not None and self.bus.connected

    def in_flight(self) -> int:
        return self._pending

    def status(self) -> dict[str, Any]:
        return {
            "bus": {"type": self.cfg.bus.type, "connected": self.bus is not None and self.bus.connected},
            "staging_dir": str(self.watcher.staging_dir),
            "latest_version": self.publisher.latest_version if self.publisher is not None else -1,
            "published": self.published,
            "pending": self._pending,
            "signing_key": self.signing_key.key_id if self.signing_key is not None else "",
            **(
                {"rank": self.cfg.publisher.rank, "ranks": self.cfg.publisher.ranks, "abandoned": self.abandoned}
                if self.parts is not None
                else {}
            ),
            **self._fence_status(),
        }

    def _fence_status(self) -> dict[str, Any]:
        if self.control is None:
            return {}
        out: dict[str, Any] = {"control": self.control.readiness(), "fenced": self.fenced}
        if self._waiting is not None:
            out["held_back"] = {"policy_version": self._waiting[0], "reason": self._waiting[1]}
        return out
