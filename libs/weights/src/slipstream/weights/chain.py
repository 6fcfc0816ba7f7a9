"""Version chains in the object store: a keyframe every K versions, deltas in between, and the way back.

Publishing (`publish_version`): encode against the last published version (or write a keyframe
when the version is a multiple of `keyframe_every`, when there is no base, or when the base does
not fit), upload the shards in parallel, write the manifest last and write-once. A version whose
manifest exists has every shard stored.

Reading (`resolve_chain`, `load_version`): a worker that holds version H and wants T follows
T's base_version links back until it reaches H (apply just the deltas after H) or a keyframe
(start over from it: a late joiner, or a worker that missed versions). Every shard is verified
against its sha256 and fetched again a bounded number of times before the load fails; a delta
is decoded only onto the exact base it names (decoder.BaseMismatch otherwise), so a failed load
leaves the caller on its current version.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from slipstream.schemas import WeightManifest, to_json
from slipstream.store import ObjectNotFound, ObjectStore
from slipstream.telemetry.logs import get_logger
from slipstream.telemetry.metrics import counter, gauge, histogram
from slipstream.weights import layout
from slipstream.weights.decoder import BaseMismatch, decode_version, fits_entry
from slipstream.weights.encoder import DEFAULT_FRAME_BYTES, DEFAULT_LEVEL, CodedVersion, delta_mismatch, encode_version
from slipstream.weights.errors import CorruptShard, VersionExists, WeightsError
from slipstream.weights.snapshot import DEFAULT_SHARD_BYTES, decode_snapshot, fetch_shards, read_manifest
from slipstream.weights.tensors import shares_memory
from slipstream.weights.upload import shard_digests, upload_shards

log = get_logger(__name__)

DEFAULT_KEYFRAME_EVERY = 10
DEFAULT_FETCH_ATTEMPTS = 3
Seal = Callable[[WeightManifest], WeightManifest]
"""Called on a manifest right before it is committed; returns what is stored (the publisher signs it here)."""
ManifestCheck = Callable[[WeightManifest], None]
"""Called on every manifest a load reads; raises to refuse the version (a verifier checks signatures here)."""
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

ENCODE_SECONDS = histogram("weights/encode/seconds", "Seconds to encode one version (label kind).", _SECONDS)
ENCODE_RATE = gauge("weights/encode/mb_per_s", "Raw MB (1e6 B) per second encoding the last version (label kind).")
STORED_FRACTION = gauge(
    "weights/version/stored_fraction", "Stored bytes / raw snapshot bytes of the last version (label kind)."
)
PUBLISHED_BYTES = counter("weights/publish/bytes", "Bytes published (label kind=keyframe|delta, size=raw|stored).")
UPLOAD_SECONDS = histogram("weights/upload/seconds", "Seconds to upload one version's shards and manifest.", _SECONDS)
KEYFRAMES_FORCED = counter("weights/publish/forced_keyframes", "Keyframes written off schedule (label reason).")
FETCH_SECONDS = histogram("weights/fetch/seconds", "Seconds to download and verify one version's shards.", _SECONDS)
SHARD_FAILURES = counter(
    "weights/fetch/shard_failures",
    "Shard reads that failed verification or found nothing (label reason=corrupt|missing); each is retried.",
)
BASE_FALLBACKS = counter(
    "weights/load/base_fallbacks", "Loads whose held base was not the version it claimed, redone from a keyframe."
)
DECODE_SECONDS = histogram("weights/decode/seconds", "Seconds to decode one version (label kind).", _SECONDS)
DECODE_RATE = gauge("weights/decode/mb_per_s", "Raw MB (1e6 B) per second decoding the last version (label kind).")


def _kind(keyframe: bool) -> str:
    return "keyframe" if keyframe else "delta"


def is_keyframe_version(version: int, keyframe_every: int) -> bool:
    """Whether `version` is due to be a keyframe (versions 0, K, 2K, ...)."""
    if keyframe_every < 1:
        raise ValueError(f"keyframe_every must be >= 1, got {keyframe_every}")
    return version % keyframe_every == 0


@dataclass(frozen=True)
class Published:
    """What `publish_version` stored: the manifest, and how long encoding and uploading took."""

    key: str
    manifest: WeightManifest
    encode_s: float
    upload_s: float


def publish_version(
    store: ObjectStore,
    *,
    run_id: str,
    version: int,
    tensors: Mapping[str, torch.Tensor],
    base: tuple[int, Mapping[str, torch.Tensor]] | None = None,
    keyframe_every: int = DEFAULT_KEYFRAME_EVERY,
    step_finished_at: float = 0.0,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    frame_bytes: int = DEFAULT_FRAME_BYTES,
    level: int = DEFAULT_LEVEL,
    threads: int = 0,
    fence_token: int = 0,
    seal: Seal | None = None,
) -> Published:
    """Store `version` as a delta against `base` = (its version, its tensors), or as a keyframe.

    A keyframe is written when the version is due (`is_keyframe_version`), when `base` is None,
    when the base's tensors do not match (names, dtypes, shapes) or when the base version has
    no manifest in the store (a delta on it could never be resolved). Raises VersionExists if
    `version` is already committed. `fence_token` is recorded in the manifest; `seal` (a signer)
    sees the manifest last.
    """
    due = is_keyframe_version(version, keyframe_every)
    mkey = layout.manifest_key(run_id, version)
    if store.exists(mkey):
        raise VersionExists(f"weight version {version} of run {run_id} is already published ({mkey})")
    if base is not None and base[0] >= version:
        raise ValueError(f"base version {base[0]} must be older than version {version}")
    delta_base = None if base is None or due else base
    if delta_base is not None:
        label, reason = "mismatch", delta_mismatch(tensors, delta_base[1])
        if reason is None and not store.exists(layout.manifest_key(run_id, delta_base[0])):
            label, reason = "base_missing", f"base version {delta_base[0]} is not in the store"
        if reason is not None:
            log.warning("version %d: writing a keyframe instead of a delta: %s", version, reason)
            KEYFRAMES_FORCED.add(1, reason=label)
            delta_base = None
    coded = encode_version(
        tensors,
        None if delta_base is None else delta_base[1],
        level=level,
        threads=threads,
        frame_bytes=frame_bytes,
        shard_bytes=shard_bytes,
    )
    kind = _kind(coded.keyframe)
    ENCODE_SECONDS.observe(coded.seconds, kind=kind)
    ENCODE_RATE.set(coded.raw_bytes / max(coded.seconds, 1e-9) / 1e6, kind=kind)
    t0 = time.perf_counter()
    manifest = store_coded(
        store,
        coded,
        run_id=run_id,
        version=version,
        base_version=None if delta_base is None else delta_base[0],
        step_finished_at=step_finished_at,
        fence_token=fence_token,
        seal=seal,
    )
    upload_s = time.perf_counter() - t0
    UPLOAD_SECONDS.observe(upload_s)
    STORED_FRACTION.set(coded.stored_bytes / max(1, coded.raw_bytes), kind=kind)
    PUBLISHED_BYTES.add(coded.raw_bytes, kind=kind, size="raw")
    PUBLISHED_BYTES.add(coded.stored_bytes, kind=kind, size="stored")
    return Published(key=mkey, manifest=manifest, encode_s=coded.seconds, upload_s=upload_s)


def store_coded(
    store: ObjectStore,
    coded: CodedVersion,
    *,
    run_id: str,
    version: int,
    base_version: int | None,
    step_finished_at: float = 0.0,
    fence_token: int = 0,
    seal: Seal | None = None,
) -> WeightManifest:
    """Upload an encoded version's shards in parallel, then commit its manifest (write-once)."""
    if coded.keyframe != (base_version is None):
        raise ValueError("a keyframe has no base version and a delta needs one")
    manifest = upload_shards(
        store,
        coded,
        lambda i: layout.shard_key(run_id, version, i),
        run_id=run_id,
        version=version,
        base_version=base_version,
        step_finished_at=step_finished_at,
        fence_token=fence_token,
    )
    if seal is not None:
        manifest = seal(manifest)
    mkey = layout.manifest_key(run_id, version)
    if not store.put_if_absent(mkey, to_json(manifest)):
        raise VersionExists(f"weight version {version} of run {run_id} was committed concurrently ({mkey})")
    return manifest


def resolve_chain(
    store: ObjectStore,
    run_id: str,
    target_version: int,
    have_version: int | None = None,
    *,
    check: ManifestCheck | None = None,
) -> list[WeightManifest]:
    """The manifests to apply, oldest first, to go from `have_version` (or nothing) to `target_version`.

    Empty when `have_version == target_version`; the deltas after `have_version` when it lies on
    the target's chain; otherwise the latest keyframe at or before the target and the deltas
    after it. Raises WeightsError when a manifest on the way is missing or inconsistent, and
    whatever `check` raises for a manifest it refuses.
    """
    chain: list[WeightManifest] = []
    v = target_version
    while v != have_version:
        m = read_manifest(store, layout.manifest_key(run_id, v))
        if m.policy_version != v:
            raise WeightsError(f"manifest of version {v} says it is version {m.policy_version}")
        if check is not None:
            check(m)
        chain.append(m)
        if m.keyframe:
            break
        if m.base_version is None or m.base_version >= v:
            raise WeightsError(f"version {v} is a delta with an invalid base version {m.base_version}")
        v = m.base_version
    chain.reverse()
    return chain


def fetch_verified(
    store: ObjectStore,
    manifest: WeightManifest,
    *,
    attempts: int = DEFAULT_FETCH_ATTEMPTS,
    retry_delay_s: float = 0.05,
    threads: int = 0,
) -> list[bytes]:
    """Every shard of `manifest`, each checked against its size and sha256.

    A shard that is missing or fails verification is fetched again, up to `attempts` fetches
    in all; then CorruptShard (or WeightsError for a missing one) is raised and nothing is returned.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    t0 = time.perf_counter()
    got: dict[int, bytes] = {}
    pending = list(range(len(manifest.shards)))
    failure: WeightsError | None = None
    for attempt in range(1, attempts + 1):
        if attempt > 1:
            time.sleep(retry_delay_s * (attempt - 1))
        fetched, missing = _get_shards(store, [manifest.shards[i].key for i in pending])
        candidates = [(i, fetched[manifest.shards[i].key]) for i in pending if manifest.shards[i].key in fetched]
        digests = shard_digests([d for _, d in candidates], threads)
        still: list[int] = []
        for (i, data), digest in zip(candidates, digests, strict=True):
            ref = manifest.shards[i]
            if len(data) == ref.size and digest == ref.sha256:
                got[i] = data
            else:
                failure = CorruptShard(ref.key, ref.sha256, digest)
                SHARD_FAILURES.add(1, reason="corrupt")
                still.append(i)
        for i in pending:
            if manifest.shards[i].key in missing:
                failure = WeightsError(f"version {manifest.policy_version}: missing shard {manifest.shards[i].key}")
                SHARD_FAILURES.add(1, reason="missing")
                still.append(i)
        pending = sorted(still)
        if not pending:
            FETCH_SECONDS.observe(time.perf_counter() - t0)
            return [got[i] for i in range(len(manifest.shards))]
        log.warning(
            "version %d: %d shard(s) failed (attempt %d of %d): %s",
            manifest.policy_version,
            len(pending),
            attempt,
            attempts,
            failure,
        )
    assert failure is not None
    raise failure


def _get_shards(store: ObjectStore, keys: list[str]) -> tuple[dict[str, bytes], set[str]]:
    try:
        return store.get_many(keys), set()
    except ObjectNotFound:
        pass  # find out which ones: the rest are still worth having
    got: dict[str, bytes] = {}
    missing: set[str] = set()
    for k in keys:
        try:
            got[k] = store.get(k)
        except ObjectNotFound:
            missing.add(k)
    return got, missing


def apply_chain(
    store: ObjectStore,
    chain: list[WeightManifest],
    base: Mapping[str, torch.Tensor] | None = None,
    *,
    base_version: int | None = None,
    inplace: bool = False,
    spare: Mapping[str, torch.Tensor] | None = None,
    threads: int = 0,
    attempts: int = DEFAULT_FETCH_ATTEMPTS,
) -> dict[str, torch.Tensor]:
    """Fetch, verify and decode `chain` (from resolve_chain) onto `base` (which holds `base_version`).

    `base` is left untouched unless `inplace`; versions after the first decode in place into
    tensors this call allocated. `spare`: tensors nothing reads any more (an older version), to
    decode the first version into instead of fresh memory, which the kernel would have to fault
    in and zero first; ignored unless it holds exactly the version's names, dtypes and shapes as
    contiguous CPU tensors sharing no memory with `base`. Raises (CorruptShard, BaseMismatch,
    WeightsError) without having changed `base` unless `inplace` was asked for; `spare` may have
    been written either way.
    """
    if not chain:
        if base is None:
            raise WeightsError("apply_chain: nothing to apply and no base")
        return dict(base)
    state: Mapping[str, torch.Tensor] | None = base
    have = base_version
    owned = inplace
    for m in chain:
        shards = fetch_verified(store, m, attempts=attempts, threads=threads)
        out = dict(state) if (owned and state is not None and not m.keyframe) else None
        if out is None and not owned and spare is not None and _fits(spare, m, base):
            out = dict(spare)
        t0 = time.perf_counter()
        state = decode_version(m, shards, state, base_version=have, out=out, threads=threads)
        seconds = time.perf_counter() - t0
        DECODE_SECONDS.observe(seconds, kind=_kind(m.keyframe))
        DECODE_RATE.set(m.raw_bytes / max(seconds, 1e-9) / 1e6, kind=_kind(m.keyframe))
        have = m.policy_version
        owned = True
    assert state is not None
    return dict(state)


def load_version(
    store: ObjectStore,
    run_id: str,
    version: int,
    *,
    have: tuple[int, Mapping[str, torch.Tensor]] | None = None,
    inplace: bool = False,
    spare: Mapping[str, torch.Tensor] | None = None,
    threads: int = 0,
    attempts: int = DEFAULT_FETCH_ATTEMPTS,
    check: ManifestCheck | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors of `version`, from `have` = (version held, its tensors) when on the chain, else from a keyframe.

    If the held tensors turn out not to be the content of the version they claim (BaseMismatch:
    nothing was written to them), the version is loaded from its keyframe instead. `spare`
    (see apply_chain) is written over when it fits: a worker passes the version it held before
    `have`, so that decoding reuses memory it has already touched. `check` sees every manifest
    read on the way (see `resolve_chain`).
    """
    chain = resolve_chain(store, run_id, version, None if have is None else have[0], check=check)
    if have is None or not chain or chain[0].keyframe:
        # A chain that starts with a keyframe does not need the held tensors at all.
        base = None if have is None or chain else have[1]
        return apply_chain(store, chain, base, spare=spare, threads=threads, attempts=attempts)
    try:
        return apply_chain(
            store,
            chain,
            have[1],
            base_version=have[0],
            inplace=inplace,
            spare=spare,
            threads=threads,
            attempts=attempts,
        )
    except BaseMismatch as exc:
        log.warning("version %d: %s; loading it from its keyframe instead", version, exc)
        BASE_FALLBACKS.add(1)
    return apply_chain(
        store, resolve_chain(store, run_id, version, check=check), spare=spare, threads=threads, attempts=attempts
    )


def _fits(spare: Mapping[str, torch.Tensor], m: WeightManifest, base: Mapping[str, torch.Tensor] | None) -> bool:
    """Whether version `m` can be decoded into `spare` (see apply_chain)."""
    if len(spare) != len(m.tensors):
        return False
    for e in m.tensors:
        t = spare.get(e.name)
        if t is None or not fits_entry(t, e) or t.device.type != "cpu" or not t.is_contiguous():
            return False
    # Decoding into memory the base shares would overwrite the base while it is still read.
    return base is None or not shares_memory(spare.values(), base.values())


def latest_version(store: ObjectStore, run_id: str) -> int | None:
    """The newest committed version of `run_id` (from the manifests in the store), or None."""
    prefix = layout.version_prefix(run_id, 0).rsplit("/", 1)[0] + "/"
    suffix = "/" + layout.manifest_key(run_id, 0).rsplit("/", 1)[1]
    versions = [layout.version_of_manifest_key(k) for k in store.list(prefix) if k.endswith(suffix)]
    return max(versions, default=None)


def fetch_version(store: ObjectStore, manifest_key: str) -> tuple[WeightManifest, dict[str, torch.Tensor]]:
    """Manifest + verified tensors of any committed version: a raw snapshot, a keyframe, or a delta
    (resolved from the latest keyframe at or before it plus the deltas after it)."""
    manifest = read_manifest(store, manifest_key)
    if manifest.keyframe and all(s.codec == "raw" for s in manifest.shards):
        return manifest, decode_snapshot(manifest, fetch_shards(store, manifest))
    return manifest, load_version(store, manifest.run_id, manifest.policy_version)
