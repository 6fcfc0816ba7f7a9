"""The codec seam: how one version's tensors become stored shards and a manifest, in one call.

`VersionStore.store` encodes each version against the last one this publisher stored (XOR of
the bit patterns or sparse index+value per tensor, zstd frames on a thread pool; see
`slipstream.weights.chain`), with a full keyframe every `keyframe_every` versions so a new worker
can join without replaying history. Shards upload in parallel, each with its sha256; the manifest
is written last and write-once. `codec = "snapshot"` stores every version in full instead.

The base survives restarts: a publisher that starts (or finds a gap) rebuilds it from the store
(`load_version` of the newest committed version) before encoding against it; without one, the
version is stored as a keyframe. A version whose manifest is already committed (a publisher that
stored it and died before announcing, or a second writer) is not written again: its committed
manifest is returned with `already_stored=True`, for the publisher to announce again.

With a signing key (`[trust] signing_key`), every manifest records the fencing token its version
was staged under and is signed (slipstream.trust) right before it is committed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from slipstream.schemas import WeightManifest
from slipstream.store import ObjectStore
from slipstream.telemetry.metrics import gauge, histogram
from slipstream.trust import SigningKey, sign_manifest
from slipstream.weights import VersionExists, manifest_key, publish_snapshot, read_manifest
from slipstream.weights.chain import latest_version, load_version, publish_version

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
STORED_FRACTION = gauge("publisher/delta/stored_fraction", "Stored bytes / raw bytes of the last version")
ENCODE_SECONDS = histogram("publisher/delta/encode_s", "Seconds to encode one version")
UPLOAD_SECONDS = histogram("publisher/delta/upload_s", "Seconds to upload one version's shards and manifest")


@dataclass(frozen=True)
class StoredVersion:
    version: int
    manifest_key: str
    manifest: WeightManifest
    already_stored: bool  # True: committed before this call; nothing was uploaded


class VersionStore:
    """Stores versions one after another, each as a delta on the previous (or a keyframe)."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        run_id: str,
        shard_bytes: int,
        codec: Literal["delta", "snapshot"] = "delta",
        keyframe_every: int = 10,
        zstd_level: int = 1,
        threads: int = 0,
        signing_key: SigningKey | None = None,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.shard_bytes = shard_bytes
        self.codec = codec
        self.keyframe_every = keyframe_every
        self.zstd_level = zstd_level
        self.threads = threads
        self.signing_key = signing_key
        self._base: tuple[int, Mapping[str, torch.Tensor]] | None = None
        self._recovered = False

    def _recover_base(self, version: int) -> None:
        """After a (re)start: the newest committed version below `version`, decoded, as the base."""
        self._recovered = True
        latest = latest_version(self.store, self.run_id)
        if latest is None or latest >= version:
            return
        try:
            self._base = (latest, load_version(self.store, self.run_id, latest, threads=self.threads))
            log.info("rebuilt delta base from the store", extra={"base_version": latest})
        except Exception as exc:  # an unreadable chain: the next version is a keyframe, nothing is lost
            log.warning("cannot rebuild the delta base (%s); the next version is a keyframe", exc)

    def _seal(self, manifest: WeightManifest) -> WeightManifest:
        return manifest if self.signing_key is None else sign_manifest(manifest, self.signing_key)

    def store_version(
        self,
        *,
        version: int,
        load: Callable[[], Mapping[str, torch.Tensor]],
        step_finished_at: float,
        fence_token: int = 0,
    ) -> StoredVersion:
        """Store `version` (tensors from `load()`, called only when needed) under `fence_token`. Blocking."""
        key = manifest_key(self.run_id, version)
        if self.store.exists(key):
            return self._committed(version, key, load)
        if self.codec == "delta" and not self._recovered:
            self._recover_base(version)
        tensors = load()
        try:
            if self.codec == "snapshot":
                key, manifest = publish_snapshot(
                    self.store,
                    run_id=self.run_id,
                    version=version,
                    tensors=tensors,
                    step_finished_at=step_finished_at,
                    shard_bytes=self.shard_bytes,
                    fence_token=fence_token,
                    seal=self._seal,
                )
            else:
                t0 = time.monotonic()
                published = publish_version(
                    self.store,
                    run_id=self.run_id,
                    version=version,
                    tensors=tensors,
                    base=self._base,
                    keyframe_every=self.keyframe_every,
                    step_finished_at=step_finished_at,
                    shard_bytes=self.shard_bytes,
                    level=self.zstd_level,
                    threads=self.threads,
                    fence_token=fence_token,
                    seal=self._seal,
                )
                key, manifest = published.key, published.manifest
                ENCODE_SECONDS.observe(published.encode_s)
                UPLOAD_SECONDS.observe(published.upload_s)
                log.debug("stored version %d in %.3fs", version, time.monotonic() - t0)
        except VersionExists:
            return self._committed(version, key, load)  # another writer committed it first: theirs stands
        if manifest.raw_bytes:
            STORED_FRACTION.set(manifest.stored_bytes / manifest.raw_bytes)
        self._base = (version, tensors)
        return StoredVersion(version, key, manifest, already_stored=False)

    def _committed(self, version: int, key: str, load: Callable[[], Mapping[str, torch.Tensor]]) -> StoredVersion:
        # The staged file holds exactly the committed version: it is the next base.
        self._base = (version, load())
        self._recovered = True
        return StoredVersion(version, key, read_manifest(self.store, key), already_stored=True)
