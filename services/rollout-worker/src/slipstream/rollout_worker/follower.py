"""The watcher: follow `weights.announce` (or `weights.promoted`) and move the engine there in flight.

Two coroutines share one slot, "the version to apply next": the reader fills it from an ordered
subscription (`deliver="last"`, so a worker that starts late begins from the newest message,
never replays history), and the applier takes whatever is in the slot when it is free, so a
worker that falls behind skips intermediate versions instead of queueing them.

Two modes (`[worker] follow`):

- `latest` (training): every `weights.announce` of the run; only newer versions are applied.
- `promoted` (serving): only `weights.promoted` of the run, i.e. the versions eval-gate (or an
  operator) promoted. The newest promotion message is the target whatever its number, so a
  rollback to an older version moves the engine back. An announced but unpromoted version is
  never applied. Before the first promotion the engine keeps its initial weights (`[model]`).
  With `track_announced` (a serving endpoint with admission control) the announces are read too,
  verified, and only their version noted (`announced`): how far the learner is ahead of what
  this worker serves.

Applying a version: fetch the manifest and its shards from the object store in a thread and
decode them (`slipstream.weights.chain.load_version`: a delta is applied only onto the exact
version it was made from — the one this worker holds — otherwise the latest keyframe plus the
deltas after it is fetched; every shard's sha256 is verified and a bad shard refetched a bounded
number of times), retrying with backoff; cast to the engine's dtype and device; then
`engine.apply_weights`, which takes effect between two decode steps of the rollouts in flight.
A version that cannot be fetched or applied is skipped, counted and logged, and the worker
keeps generating with what it has: a half-written or corrupt version is never applied.

With tracing on, each application is a `weights.apply` span, child of the announce's (or
promotion's) context from its headers, so it closes the trace learner step -> weights.publish ->
announce; it carries the version, this worker's id and the pause it cost.

Before an announce can become the version to apply, the verifier (`slipstream.trust`) checks it:
its manifest exists, names the same run and version, is signed by a trusted key, and carries the
fencing token the announce claims, one the control plane granted. A refused announce is counted
and dropped before it touches the slot, so a forged version far ahead never hides the real
versions below it; every manifest on the chain a load reads is checked again. A version that
passes but then cannot be fetched is dropped from the slot too, so the next announce is taken.

A pinned follower (`pinned=True`, the sub-agent pool) loads exactly one version once
(`load_pinned`) and then only reads: every announce is noted (`announced`, counted as
`pinned_ignored`) and never becomes the version to apply, so the engine and its bytes stay put.

Every applied version leaves a row in `status()["weight_applies"]` (the worker's /readyz; a training
run copies them into its summary): the version, `apply_ms` (the engine's own time to load it:
TorchEngine's copy between two decode steps, VllmEngine's write + load + cache reset, LoRA merge
included), `wait_ms` (VllmEngine only: how long the update waited for the requests in flight; None
for an engine that does not wait) and `switch_ms` (from `apply_weights` until the engine reported the
version, as this follower saw it).

Time-to-policy is the optimizer step's end (`step_finished_at`, from the announcement) to the
first token sampled under the version: the moment the engine switched if a rollout was running
then, else the start of the first rollout after it. Rollouts report back through `note_rollout`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Mapping
from typing import Any, Literal

import torch
from opentelemetry.context import Context

from slipstream.bus import Bus
from slipstream.bus.tracing import AttributeValue, service_span, tracing_active
from slipstream.engine.interface import Engine, RemoteWeights
from slipstream.rollout_worker.instruments import (
    ANNOUNCES_SKIPPED,
    APPLIED_VERSION,
    FETCH_FAILURES,
    FETCH_S,
    PAUSE_MS,
    PINNED_IGNORED,
    TIME_TO_POLICY_S,
)
from slipstream.runtime.backoff import Backoff
from slipstream.schemas import Episode, WeightAnnounce, WeightsPromoted
from slipstream.schemas.subjects import WEIGHTS_ANNOUNCE, WEIGHTS_PROMOTED
from slipstream.store import ObjectStore
from slipstream.telemetry.logs import get_logger
from slipstream.trust import AnnounceVerifier
from slipstream.weights import read_manifest
from slipstream.weights.chain import load_version
from slipstream.weights.layout import manifest_key
from slipstream.weights.tensors import shares_memory

log = get_logger(__name__)
_TIED_ALIAS = {"lm_head.weight": "model.embed_tokens.weight"}
_APPLY_POLL_S = 0.005
# Versions applied but not yet seen in a rollout are forgotten once this many newer ones exist.
_PENDING_KEEP = 8
_HISTORY = 32  # applied versions listed in status(), newest last
_APPLIES_KEEP = 512  # per-version apply timings listed in status() (`weight_applies`), newest last
FollowMode = Literal["latest", "promoted"]


def engine_digest(engine: Engine) -> str:
    """sha256 over the engine's parameters (names, dtypes, bytes): equal digests = bit-identical weights."""
    from slipstream.weights.tensors import digest

    return digest(engine.state_dict())


class WeightFollower:
    """Reads announcements, fetches and verifies versions, applies them to the engine."""

    def __init__(
        self,
        bus: Bus,
        store: ObjectStore,
        engine: Engine,
        *,
        run_id: str,
        retries: int,
        backoff_s: float,
        apply_timeout_s: float = 60.0,
        mode: FollowMode = "latest",
        digest: bool = False,
        worker_id: str = "",
        verifier: AnnounceVerifier | None = None,
        track_announced: bool = False,
        pinned: bool = False,
    ) -> None:
        if mode not in ("latest", "promoted"):
            raise ValueError(f"follow mode must be 'latest' or 'promoted', got {mode!r}")
        if pinned and mode != "latest":
            raise ValueError("a pinned follower reads weights.announce only (mode 'latest')")
        self.mode = mode
        self.pinned = pinned
        self.pinned_ignored = 0
        self.verifier = verifier
        self.track_announced = track_announced and mode == "promoted"
        self.bus = bus
        self.store = store
        self.engine = engine
        self.run_id = run_id
        self.retries = retries
        self.backoff_s = backoff_s
        self.apply_timeout_s = apply_timeout_s
        self._newest: WeightAnnounce | None = None
        self._newest_context: Context | None = None  # the trace context of `_newest`'s message
        self.worker_id = worker_id
        self._wake = asyncio.Event()
        self._first_token: dict[int, tuple[float, float]] = {}  # version -> (applied_at, step_finished_at)
        self.announced = -1
        self.fence_token = 0  # highest fencing token seen on an announce of this run
        self.promoted: int | None = None  # newest promotion seen (promoted mode)
        self.history: deque[int] = deque(maxlen=_HISTORY)
        self.applied = 0
        self.failures = 0
        self.last_pause_ms = 0.0
        self.applies: deque[dict[str, Any]] = deque(maxlen=_APPLIES_KEEP)
        self.last_time_to_policy_s: float | None = None
        # The exact decoded tensors of the version last applied: deltas decode onto them (a copy,
        # in the published dtype, since the engine's own may be cast to another dtype or device).
        self._held: tuple[int, dict[str, torch.Tensor]] | None = None
        # The version held before that one, once the engine has switched past it (nothing reads
        # it any more): the next version decodes into its memory instead of fresh pages.
        self._retired: dict[str, torch.Tensor] | None = None
        self._spare: dict[str, torch.Tensor] | None = None
        self.digest_enabled = digest
        self.weights_digest = ""

    # -- the two loops ---------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Follow announcements (or promotions) until `stop`."""
        # Opened by the reader's first iteration; "last" makes that moment irrelevant.
        reader: Any
        if self.mode == "promoted":
            reader = self.bus.subscribe(WEIGHTS_PROMOTED, WeightsPromoted, deliver="last")
        else:
            reader = self.bus.subscribe(WEIGHTS_ANNOUNCE, WeightAnnounce, deliver="last")
        jobs: list[asyncio.Task[Any]] = [
            asyncio.create_task(self._read(reader), name="weights.read"),
            asyncio.create_task(self._apply_loop(), name="weights.apply"),
        ]
        announces: Any = None
        if self.track_announced:
            announces = self.bus.subscribe(WEIGHTS_ANNOUNCE, WeightAnnounce, deliver="last")
            jobs.append(asyncio.create_task(self._note_announces(announces), name="weights.announced"))
        waiter = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait([*jobs, waiter], return_when=asyncio.FIRST_COMPLETED)
            if not stop.is_set():
                # A loop that ended on its own is a failure: raise its error, or say so.
                for job in done:
                    job.result()
                raise RuntimeError(f"weight follower loop {next(iter(done)).get_name()} ended unexpectedly")
        finally:
            await reader.close()
            if announces is not None:
                await announces.close()
            for job in [*jobs, waiter]:
                job.cancel()
            await asyncio.gather(*jobs, waiter, return_exceptions=True)

    async def _read(self, reader: Any) -> None:
        async for delivery in reader:
            taken = self.offer_promoted(delivery.msg) if self.mode == "promoted" else await self.consider(delivery.msg)
            if taken:
                self._newest_context = delivery.context if tracing_active() else None

    async def _note_announces(self, reader: Any) -> None:
        async for delivery in reader:
            await self.note_announced(delivery.msg)

    async def note_announced(self, announce: WeightAnnounce) -> bool:
        """Promoted mode with `track_announced`: note how far the learner has got (nothing applied).

        Only a verified announce of this run counts, so a forged far-ahead version cannot make a
        serving endpoint refuse every call.
        """
        if announce.run_id and announce.run_id != self.run_id:
            return False
        if announce.policy_version <= self.announced:
            return False
        if self.verifier is not None and not (await self.verifier.verify(announce)).ok:
            return False
        self.announced = announce.policy_version
        return True

    def newest_version(self) -> int:
        """The newest version this worker knows of: announced, promoted or applied."""
        return max(self.announced, self.promoted if self.promoted is not None else -1, self.engine.policy_version)

    async def consider(self, announce: WeightAnnounce) -> bool:
        """Check one announcement (latest mode) and offer it; True if it became the version to apply next.

        Only an announce that would change something is verified (one manifest read): a newer
        version, or a higher fencing token (which would fence every lower one after it); old
        versions and other runs are skipped for free. A refused one is counted by the verifier and
        dropped.
        """
        if self.pinned or not self._admissible(announce):
            return self.offer(announce)  # counts why it is skipped
        if self.verifier is not None and not (await self.verifier.verify(announce)).ok:
            return False
        return self.offer(announce)

    def _admissible(self, announce: WeightAnnounce) -> bool:
        if announce.run_id and announce.run_id != self.run_id:
            return False
        if 0 < announce.fence_token < self.fence_token:
            return False
        if announce.fence_token > self.fence_token:
            return True  # it would raise the high-water mark, even on a version already held: check it
        floor = max(self.engine.policy_version, self._newest.policy_version if self._newest else -1)
        return announce.policy_version > floor

    def offer_promoted(self, promoted: WeightsPromoted) -> bool:
        """Consider one promotion (promoted mode); True if it became the version to apply next.

        The newest promotion wins even when its version is lower (a rollback).
        """
        if promoted.run_id and promoted.run_id != self.run_id:
            ANNOUNCES_SKIPPED.add(reason="other_run")
            return False
        version = promoted.policy_version
        self.promoted = version
        moving = self._newest is not None and self._wanted(self._newest)
        if version == self.engine.policy_version and not moving:
            ANNOUNCES_SKIPPED.add(reason="current")
            return False
        self._newest = WeightAnnounce(
            policy_version=version, manifest_key=promoted.manifest_key, run_id=promoted.run_id
        )
        self._wake.set()
        log.info(
            "following promotion",
            policy_version=version,
            current=self.engine.policy_version,
            previous_version=promoted.previous_version,
            reason=promoted.reason,
        )
        return True

    def _wanted(self, announce: WeightAnnounce) -> bool:
        """Should the engine move to `announce`? Latest: only forward. Promoted: wherever it points."""
        if self.mode == "promoted":
            return announce.policy_version != self.engine.policy_version
        return announce.policy_version > self.engine.policy_version

    def _reached(self, version: int) -> bool:
        if self.mode == "promoted":
            return self.engine.policy_version == version
        return self.engine.policy_version >= version

    def offer(self, announce: WeightAnnounce) -> bool:
        """Consider one announcement (latest mode); True if it became the version to apply next."""
        if announce.run_id and announce.run_id != self.run_id:
            ANNOUNCES_SKIPPED.add(reason="other_run")
            return False
        if 0 < announce.fence_token < self.fence_token:
            # Checked by its publisher, yet announced after a newer leader's version: the lease
            # moved in between, and its learner no longer leads the run. (Token 0: staged without
            # a control plane, nothing to compare.)
            ANNOUNCES_SKIPPED.add(reason="fenced")
            log.warning(
                "ignoring an announce from a learner that no longer leads the run",
                policy_version=announce.policy_version,
                fence_token=announce.fence_token,
                newest_fence_token=self.fence_token,
            )
            return False
        self.fence_token = max(self.fence_token, announce.fence_token)
        self.announced = max(self.announced, announce.policy_version)
        if self.pinned:
            # Seen, never applied: the pool serves the one version it was pinned to.
            self.pinned_ignored += 1
            PINNED_IGNORED.add()
            ANNOUNCES_SKIPPED.add(reason="pinned")
            return False
        floor = max(self.engine.policy_version, self._newest.policy_version if self._newest else -1)
        if announce.policy_version <= floor:
            ANNOUNCES_SKIPPED.add(reason="not_newer")
            return False
        self._newest = announce
        self._wake.set()
        return True

    async def load_pinned(self, version: int, *, wait_s: float = 0.0) -> None:
        """Load exactly `version` of this run into the engine (a pool's start-up); ValueError if it cannot.

        The version the engine already holds (0: [model]'s initial weights) is kept as it is. A
        version not in the store yet is waited for up to `wait_s` (the pool may start before the
        learner has published it).
        """
        if version == self.engine.policy_version:
            return
        key = manifest_key(self.run_id, version)
        announce = WeightAnnounce(policy_version=version, manifest_key=key, run_id=self.run_id)
        deadline = time.monotonic() + wait_s
        while not await self._apply(announce):
            if time.monotonic() >= deadline:
                raise ValueError(
                    f"pinned version {version} of run {self.run_id!r} could not be loaded from the store "
                    f"({announce.manifest_key}); see the log for why"
                )
            await asyncio.sleep(min(2.0, max(0.1, wait_s / 10)))

    async def _apply_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            announce, context = self._newest, self._newest_context
            if announce is not None and self._wanted(announce):
                await self.apply(announce, context=context)

    # -- one version -----------------------------------------------------------------------------
    async def apply(self, announce: WeightAnnounce, *, context: Context | None = None) -> bool:
        """Fetch, verify and apply one version; False (counted, logged) if it was skipped.

        `context`: the trace context of the message that announced it (the span's parent).
        """
        attributes: dict[str, AttributeValue] = {
            "slipstream.run_id": announce.run_id or self.run_id,
            "slipstream.policy_version": announce.policy_version,
            "slipstream.worker_id": self.worker_id,
            "slipstream.follow": self.mode,
        }
        with service_span("weights.apply", attributes, parent=context) as span:
            applied = await self._apply(announce)
            if span is not None:
                span.set_attribute("slipstream.applied", applied)
                if applied:
                    span.set_attribute("slipstream.pause_ms", self.last_pause_ms)
            return applied

    async def _apply(self, announce: WeightAnnounce) -> bool:
        version = announce.policy_version
        tensors = await self._fetch(announce)
        if tensors is None:
            if self._newest is announce:
                self._newest = None  # whatever comes next is taken, even a version below this one
            return False
        asked = time.monotonic()
        try:
            self.engine.apply_weights(version, tensors)
        except ValueError as exc:
            return self._fail(version, "apply", str(exc))
        deadline = time.monotonic() + self.apply_timeout_s
        while not self._reached(version):
            if time.monotonic() >= deadline:
                return self._fail(version, "timeout", f"engine did not switch within {self.apply_timeout_s}s")
            await asyncio.sleep(_APPLY_POLL_S)
        switch_s = time.monotonic() - asked
        applied_at = time.time()
        # The engine copied this version in, and nothing older is pending in it any more.
        self._spare, self._retired = self._retired, None
        self.applied = version
        if self.digest_enabled:
            self.weights_digest = await asyncio.to_thread(engine_digest, self.engine)
        self.history.append(version)
        row = self.note_applied(version, self.engine.stats(), switch_s)
        PAUSE_MS.observe(self.last_pause_ms)
        APPLIED_VERSION.set(float(version))
        self._first_token[version] = (applied_at, announce.step_finished_at)
        for old in [v for v in self._first_token if v <= version - _PENDING_KEEP]:
            del self._first_token[old]
        extra = {k: v for k, v in row.items() if k not in ("version", "apply_ms")}
        log.info("applied weights", policy_version=version, pause_ms=round(self.last_pause_ms, 2), **extra)
        return True

    def note_applied(self, version: int, stats: Mapping[str, float], switch_s: float) -> dict[str, Any]:
        """Record one applied version's timings from the engine's `stats()` (see the module doc); the row."""
        self.last_pause_ms = float(stats.get("last_weight_apply_ms", 0.0))
        wait = stats.get("update_wait_ms")
        row: dict[str, Any] = {
            "version": version,
            "apply_ms": round(self.last_pause_ms, 1),
            "wait_ms": None if wait is None else round(float(wait), 1),
            "switch_ms": round(switch_s * 1000.0, 1),
        }
        if stats.get("last_lora_merge_ms"):
            row["merge_ms"] = round(float(stats["last_lora_merge_ms"]), 1)
        self.applies.append(row)
        return row

    async def _fetch(self, announce: WeightAnnounce) -> dict[str, torch.Tensor] | None:
        version = announce.policy_version
        for attempt in range(self.retries + 1):
            t0 = time.perf_counter()
            try:
                manifest, tensors = await asyncio.to_thread(self._load, announce)
            except Exception as exc:  # store backends raise their own errors (OSError, botocore, WeightsError)
                if attempt == self.retries:
                    self._fail(version, "fetch", repr(exc))
                    return None
                pause = Backoff(self.backoff_s).delay(attempt)
                log.warning("weight fetch failed; retrying", policy_version=version, error=repr(exc), retry_in_s=pause)
                await asyncio.sleep(pause)
                if self._superseded(announce):
                    ANNOUNCES_SKIPPED.add(reason="superseded")
                    return None
                continue
            FETCH_S.observe(time.perf_counter() - t0)
            if manifest.policy_version != version:
                self._fail(
                    version, "mismatch", f"manifest {announce.manifest_key} holds version {manifest.policy_version}"
                )
                return None
            return await asyncio.to_thread(self._cast, tensors)
        return None

    def _load(self, announce: WeightAnnounce) -> tuple[Any, dict[str, torch.Tensor]]:
        """Manifest + tensors of the announced version, decoded onto the held version when it is the
        delta's exact base (else from the latest keyframe plus the deltas after it). Every shard's
        sha256 is verified and corrupt shards refetched (bounded) by `load_version`."""
        manifest = read_manifest(self.store, announce.manifest_key)
        check = None if self.verifier is None else self.verifier.check_chain_manifest
        tensors = load_version(
            self.store, manifest.run_id, manifest.policy_version, have=self._held, spare=self._spare, check=check
        )
        retired = None if self._held is None else self._held[1]
        if retired is not None and shares_memory(tensors.values(), retired.values()):
            retired = None  # nothing was decoded: it is still what we hold
        # The spare was written into (or did not fit): either way it is no longer free. The
        # version held until now becomes free once the engine has switched past it (_apply).
        self._spare, self._retired = None, retired
        self._held = (manifest.policy_version, tensors)
        return manifest, tensors

    def _superseded(self, announce: WeightAnnounce) -> bool:
        """A newer message replaced `announce` while it was being fetched."""
        newest = self._newest
        if newest is None or newest is announce:
            return False
        return self.mode == "promoted" or newest.policy_version > announce.policy_version

    def _cast(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors in the engine's dtype and device (a bf16 snapshot into an fp32 engine, say)."""
        if isinstance(self.engine, RemoteWeights):
            # Its parameters live in the server: cast by its description, on the CPU (the upload's side).
            specs = self.engine.param_specs()
            remote: dict[str, torch.Tensor] = {}
            for name, value in tensors.items():
                spec = specs.get(name) or specs.get(_TIED_ALIAS.get(name, ""))
                remote[name] = value if spec is None else value.to(device="cpu", dtype=getattr(torch, spec.dtype))
            return remote
        params = dict(self.engine.named_parameters())
        out: dict[str, torch.Tensor] = {}
        for name, value in tensors.items():
            target = params.get(name) if name in params else params.get(_TIED_ALIAS.get(name, ""))
            # Unknown names pass through unchanged: apply_weights rejects them, naming the tensor.
            out[name] = value if target is None else value.to(device=target.device, dtype=target.dtype)
        return out

    def _fail(self, version: int, reason: str, detail: str) -> bool:
        self.failures += 1
        FETCH_FAILURES.add(reason=reason)
        log.error(
            "weight version skipped; still sampling with the current one",
            policy_version=version,
            current=self.engine.policy_version,
            reason=reason,
            detail=detail,
        )
        return False

    # -- time to policy --------------------------------------------------------------------------
    def note_rollout(self, episodes: list[Episode]) -> None:
        """Record time-to-policy for versions seen in these rollouts for the first time."""
        if not self._first_token:
            return
        for version in list(self._first_token):
            starts = [
                e.timings.started_at
                for e in episodes
                if any(seg.policy_version == version for s in e.samples for seg in s.segments)
            ]
            if not starts:
                continue
            applied_at, step_finished_at = self._first_token.pop(version)
            first_token_at = max(applied_at, min(starts))
            if step_finished_at > 0:
                self.last_time_to_policy_s = first_token_at - step_finished_at
                TIME_TO_POLICY_S.observe(self.last_time_to_policy_s)

    def status(self) -> dict[str, Any]:
        return {
            "weights_sha256": self.weights_digest,
            "follow": self.mode,
            "policy_version": self.engine.policy_version,
            "announced_version": self.announced,
            "fence_token": self.fence_token,
            "promoted_version": self.promoted,
            "applied_versions": list(self.history),
            "pending_version": (
                self._newest.policy_version if self._newest is not None and self._wanted(self._newest) else None
            ),
            "fetch_failures": self.failures,
            "pinned": self.pinned,
            "pinned_ignored": self.pinned_ignored,
            "announces": self.verifier.status() if self.verifier is not None else {"signatures": "unchecked"},
            "last_pause_ms": round(self.last_pause_ms, 3),
            "weight_applies": list(self.applies),
            "last_time_to_policy_s": self.last_time_to_policy_s,
        }
