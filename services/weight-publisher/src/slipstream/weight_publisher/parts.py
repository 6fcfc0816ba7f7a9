"""One learner rank's publisher (`[publisher] ranks` > 1): store this rank's part; rank 0 also commits the manifest.

    rank r:  staged part --encode vs own base--> v<version>/rank-<r>/shards + part.json
    rank 0:  ... then wait for every rank's part.json --merge--> manifest.json (signed, last) --> announce
             or, a part missing after `part_timeout_s` / parts that do not fit --> abandoned.json, no announce
    rank >0: ... then wait for the version's fate (manifest or abandon record, both written by rank 0)

Every publisher moves to the next version only once the fate of this one is known, so all ranks
encode version v+1 against the same base: v when it was committed, else the last committed
version (slipstream.weights.parts has the store layout and the merge rules). A wait that a stop
or the fate wait's bound cuts short raises `PartPending`: the staged part stays, and the next
attempt (or start) finds its part record and goes on waiting, uploading nothing again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from slipstream.schemas import AbandonedVersion, from_json
from slipstream.store import ObjectNotFound, ObjectStore
from slipstream.telemetry.metrics import counter
from slipstream.trust import SigningKey, sign_manifest
from slipstream.weight_publisher.codec import StoredVersion
from slipstream.weights import layout, read_manifest
from slipstream.weights.chain import latest_version, load_version
from slipstream.weights.errors import VersionExists
from slipstream.weights.parts import (
    PartsError,
    abandon,
    commit_merged,
    decided_after,
    fate,
    merge_parts,
    publish_part,
    read_parts,
)

if TYPE_CHECKING:
    import torch

    from slipstream.schemas import WeightManifest

log = logging.getLogger(__name__)
PARTS_STORED = counter("publisher/parts/stored", "Rank parts stored (label existing=true when found already stored).")
ABANDONED = counter(
    "publisher/parts/abandoned",
    "Versions never committed nor announced because a rank's part did not arrive or did not fit (label reason).",
)

ORPHANED = counter(
    "publisher/parts/orphaned",
    "Parts dropped by a rank > 0 because rank 0 settled later versions without ever having this one staged.",
)


class VersionAbandoned(Exception):
    """The version will never be committed (its abandon record names why); drop the staged part."""


class PartPending(Exception):
    """The version's fate is not known yet (a stop, or the fate wait's bound); retry the staged part later."""


class PartStore:
    """Stores one rank's part of each version and learns (rank 0: decides) the version's fate."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        run_id: str,
        rank: int,
        ranks: int,
        part_timeout_s: float,
        poll_s: float = 0.05,
        shard_bytes: int,
        keyframe_every: int = 10,
        zstd_level: int = 1,
        threads: int = 0,
        signing_key: SigningKey | None = None,
    ) -> None:
        if not 0 <= rank < ranks or ranks < 2:
            raise ValueError(f"a part publisher needs 0 <= rank < ranks and ranks >= 2, got rank {rank} of {ranks}")
        self.store = store
        self.run_id = run_id
        self.rank = rank
        self.ranks = ranks
        self.part_timeout_s = part_timeout_s
        self.poll_s = poll_s
        self.shard_bytes = shard_bytes
        self.keyframe_every = keyframe_every
        self.zstd_level = zstd_level
        self.threads = threads
        self.signing_key = signing_key
        self.stopping: Callable[[], bool] = lambda: False
        """Set by the service: a wait returns (PartPending) once this says the service is stopping."""
        self._base: tuple[int, Mapping[str, torch.Tensor]] | None = None
        self._recovered = False

    def _seal(self, manifest: WeightManifest) -> WeightManifest:
        return manifest if self.signing_key is None else sign_manifest(manifest, self.signing_key)

    def _recover_base(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """After a (re)start: this rank's tensors of the newest committed version below `version`, as the base."""
        self._recovered = True
        latest = latest_version(self.store, self.run_id)
        if latest is None or latest >= version:
            return
        try:
            full = load_version(self.store, self.run_id, latest, threads=self.threads)
        except Exception as exc:  # an unreadable chain: this part is a keyframe, nothing is lost
            log.warning("cannot rebuild the delta base from the store (%s); this part is a keyframe", exc)
            return
        if all(name in full for name in tensors):
            self._base = (latest, {name: full[name] for name in tensors})

    def publish(
        self,
        *,
        version: int,
        load: Callable[[], Mapping[str, torch.Tensor]],
        step_finished_at: float,
        fence_token: int = 0,
    ) -> StoredVersion | None:
        """Store this rank's part of `version` and see the version settled. Blocking.

        Returns the committed manifest for rank 0 to announce (`already_stored` when it was
        committed before this call), None for the other ranks once the version is committed.
        Raises VersionAbandoned when the version will never be committed, PartPending when its
        fate is not known yet.
        """
        settled = fate(self.store, self.run_id, version)
        if settled == "abandoned":
            raise VersionAbandoned(self._abandon_reason(version))
        tensors = load()
        if settled == "committed":
            self._base = (version, tensors)  # the staged part is exactly this rank's part of it
            self._recovered = True
            return self._committed(version) if self.rank == 0 else None
        if not self._recovered:
            self._recover_base(version, tensors)
        record, existed = publish_part(
            self.store,
            run_id=self.run_id,
            version=version,
            rank=self.rank,
            tensors=tensors,
            base=self._base,
            keyframe_every=self.keyframe_every,
            step_finished_at=step_finished_at,
            shard_bytes=self.shard_bytes,
            level=self.zstd_level,
            threads=self.threads,
            fence_token=fence_token,
        )
        PARTS_STORED.add(1, existing=str(existed).lower())
        log.debug("stored part %d of version %d (%d bytes)", self.rank, version, record.stored_bytes)
        stored = None
        if self.rank == 0:
            stored = self._commit(version)
        else:
            self._await_fate(version)
        self._base = (version, tensors)
        return stored

    def _commit(self, version: int) -> StoredVersion:
        """Rank 0: wait for every part (up to part_timeout_s), then commit the merged manifest or abandon."""
        deadline = time.monotonic() + self.part_timeout_s
        while True:
            parts = read_parts(self.store, self.run_id, version, self.ranks)
            missing = [r for r in range(self.ranks) if r not in parts]
            if not missing:
                break
            if time.monotonic() >= deadline:
                reason = f"no part from rank(s) {missing} within {self.part_timeout_s:g} s"
                self._abandon(version, reason, "missing", missing)
                return self._committed(version)
            if self.stopping():
                raise PartPending(f"version {version}: stopping while waiting for the part(s) of rank(s) {missing}")
            time.sleep(self.poll_s)
        try:
            manifest = merge_parts(parts, run_id=self.run_id, version=version, ranks=self.ranks)
        except PartsError as exc:
            self._abandon(version, str(exc), "mismatch", [])
            return self._committed(version)
        try:
            key, committed = commit_merged(self.store, manifest, seal=self._seal)
        except VersionExists:
            if fate(self.store, self.run_id, version) == "abandoned":
                raise VersionAbandoned(self._abandon_reason(version)) from None
            return self._committed(version)  # committed by an earlier start of this publisher
        return StoredVersion(version, key, committed, already_stored=False)

    def _committed(self, version: int) -> StoredVersion:
        key = layout.manifest_key(self.run_id, version)
        return StoredVersion(version, key, read_manifest(self.store, key), already_stored=True)

    def _abandon(self, version: int, reason: str, label: str, missing: list[int]) -> None:
        """Write the abandon record and raise VersionAbandoned; returns only when the version is committed."""
        try:
            if abandon(self.store, self.run_id, version, reason, missing):
                ABANDONED.add(1, reason=label)
        except VersionExists:
            return  # committed after all (by an earlier start): the caller's commit finds it
        raise VersionAbandoned(self._abandon_reason(version))

    def _await_fate(self, version: int) -> None:
        """Ranks > 0: wait until rank 0 committed or abandoned the version (bounded: PartPending after it)."""
        deadline = time.monotonic() + 2 * self.part_timeout_s
        while True:
            settled = fate(self.store, self.run_id, version)
            if settled == "committed":
                return
            if settled == "abandoned":
                raise VersionAbandoned(self._abandon_reason(version))
            if self.stopping():
                raise PartPending(f"version {version}: stopping while rank 0 has not committed or abandoned it")
            if time.monotonic() >= deadline:
                later = decided_after(self.store, self.run_id, version)
                if later is not None:
                    # Rank 0 settles versions in order: it went past this one without ever having it staged.
                    ORPHANED.add(1)
                    raise VersionAbandoned(f"version {version}: rank 0 settled version {later} and never this one")
                raise PartPending(f"version {version}: rank 0 has not committed or abandoned it yet")
            time.sleep(self.poll_s)

    def _abandon_reason(self, version: int) -> str:
        try:
            record = from_json(self.store.get(layout.abandoned_key(self.run_id, version)), AbandonedVersion)
        except ObjectNotFound:
            return f"version {version} was abandoned"
        return f"version {version} abandoned: {record.reason}"
