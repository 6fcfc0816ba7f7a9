"""The check every consumer of `weights.announce` runs before acting on one.

    announce --> manifest in the store? --> same run and version? --> signed by a trusted key?
             --> fence token the one signed, and one the control plane granted? --> accepted

A refused announce is counted (`weights/announce/refused`, label reason), logged, and remembered
for `status()`; the caller then drops it, so it can never hold back the versions after it (a
worker that refused version 1000 still applies 7 when 7 arrives). Reasons:

- `missing_manifest`: no manifest under the announced key (a version far ahead, never stored);
- `unfetchable`: the store failed for longer than `verify_timeout_s`;
- `tampered`: the manifest does not decode, or names another run or version than the announce;
- `unsigned`, `unknown_key`, `bad_signature`: with a keyring, a manifest without a signature,
  signed by a key not in the keyring, or whose signature does not match its content;
- `fence`: the announce's fencing token is not the one signed into the manifest, or (with a
  control plane) is above every token the run's lease ever granted.

Without trusted keys the signature step is skipped (said once at start and in `status()`); the
other checks always run. While Redis cannot be asked, the granted-token comparison is skipped
and counted (`weights/announce/fence_unchecked`): the signed token still binds the announce.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import msgspec

from slipstream.control import Control, ControlUnavailable
from slipstream.runtime.backoff import Backoff
from slipstream.schemas import WeightAnnounce, WeightManifest, from_json
from slipstream.store import ObjectNotFound, ObjectStore
from slipstream.telemetry.logs import get_logger
from slipstream.telemetry.metrics import counter
from slipstream.trust.keys import Keyring
from slipstream.trust.signing import Check, check_manifest

log = get_logger(__name__)

REFUSED = counter(
    "weights/announce/refused",
    "Weight announces refused before anything acted on them (label reason: missing_manifest, unfetchable, "
    "tampered, unsigned, unknown_key, bad_signature, fence).",
)
ACCEPTED = counter("weights/announce/verified", "Weight announces whose manifest was found, consistent and trusted.")
FENCE_UNCHECKED = counter(
    "weights/announce/fence_unchecked", "Announces accepted without asking Redis for the granted token (Redis away)."
)
REASONS = ("missing_manifest", "unfetchable", "tampered", "unsigned", "unknown_key", "bad_signature", "fence")
_RETRY_S = 0.1


class Untrusted(ValueError):
    """A manifest on a version's chain that fails the signature check (raised while loading it)."""


@dataclass(frozen=True)
class Verdict:
    """The outcome of one announce: `manifest` when accepted, `reason` and `detail` when refused."""

    manifest: WeightManifest | None
    reason: str = ""
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.manifest is not None


class AnnounceVerifier:
    """Checks announces of one run against the store, the keyring and (optionally) the control plane."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        run_id: str,
        keyring: Keyring,
        control: Control | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.keyring = keyring
        self.control = control
        self.timeout_s = timeout_s
        self.refused: Counter[str] = Counter()
        self.accepted = 0
        self.last_refused: dict[str, Any] | None = None
        if not keyring:
            log.warning("no trusted keys configured: weight announces are checked without signatures", run_id=run_id)

    async def verify(self, announce: WeightAnnounce) -> Verdict:
        """Accept or refuse one announce of this run (see the module docstring); counts either way."""
        verdict = await self._verify(announce)
        if verdict.ok:
            self.accepted += 1
            ACCEPTED.add(1)
            return verdict
        self.refused[verdict.reason] += 1
        REFUSED.add(1, reason=verdict.reason)
        self.last_refused = {
            "policy_version": announce.policy_version,
            "reason": verdict.reason,
            "detail": verdict.detail,
            "at": time.time(),
        }
        log.warning(
            "weight announce refused",
            policy_version=announce.policy_version,
            fence_token=announce.fence_token,
            manifest_key=announce.manifest_key,
            reason=verdict.reason,
            detail=verdict.detail,
        )
        return verdict

    async def _verify(self, announce: WeightAnnounce) -> Verdict:
        got = await self._fetch(announce.manifest_key)
        if isinstance(got, Verdict):
            return got
        try:
            manifest = from_json(got, WeightManifest)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            return Verdict(None, "tampered", f"manifest {announce.manifest_key} does not decode: {exc}")
        if manifest.run_id != self.run_id or manifest.policy_version != announce.policy_version:
            return Verdict(
                None,
                "tampered",
                f"manifest {announce.manifest_key} is version {manifest.policy_version} of run {manifest.run_id!r}, "
                f"the announce says version {announce.policy_version} of run {self.run_id!r}",
            )
        refused = self.check(manifest)
        if refused is not None:
            return refused
        if announce.fence_token != manifest.fence_token:
            return Verdict(
                None,
                "fence",
                f"announce carries fencing token {announce.fence_token}, the manifest was staged under "
                f"{manifest.fence_token}",
            )
        return await self._granted(announce, manifest)

    def check(self, manifest: WeightManifest) -> Verdict | None:
        """The signature step alone: None when `manifest` passes (or no keyring is set), else the refusal."""
        if not self.keyring:
            return None
        outcome = check_manifest(manifest, self.keyring)
        if outcome is Check.OK:
            return None
        detail = {
            Check.UNSIGNED: "the manifest carries no signature",
            Check.UNKNOWN_KEY: f"signed by key {manifest.key_id!r}, not one of the trusted {self.keyring.ids}",
            Check.BAD_SIGNATURE: f"the signature by key {manifest.key_id!r} does not match the manifest's content",
        }[outcome]
        return Verdict(None, outcome.value, f"version {manifest.policy_version}: {detail}")

    def check_chain_manifest(self, manifest: WeightManifest) -> None:
        """For `load_version(check=...)`: raise Untrusted when a manifest on the chain fails the signature step."""
        refused = self.check(manifest)
        if refused is not None:
            raise Untrusted(f"{refused.reason}: {refused.detail}")

    async def _fetch(self, key: str) -> bytes | Verdict:
        deadline = time.monotonic() + self.timeout_s
        retry = Backoff(_RETRY_S, max_s=1.0)
        while True:
            try:
                left = max(deadline - time.monotonic(), 0.001)
                return await asyncio.wait_for(asyncio.to_thread(self.store.get, key), left)
            except ObjectNotFound:
                # Manifests are written before their announce: a missing one was never stored.
                return Verdict(None, "missing_manifest", f"no manifest at {key}")
            except Exception as exc:  # store backends raise their own errors (OSError, botocore, timeouts)
                pause = next(retry)
                if time.monotonic() + pause >= deadline:
                    return Verdict(None, "unfetchable", f"manifest {key}: {exc!r} for {self.timeout_s:.1f} s")
                await asyncio.sleep(pause)

    async def _granted(self, announce: WeightAnnounce, manifest: WeightManifest) -> Verdict:
        if self.control is None or manifest.fence_token == 0:
            return Verdict(manifest)
        try:
            granted = await self.control.granted_fence()
        except ControlUnavailable:
            FENCE_UNCHECKED.add(1)
            return Verdict(manifest)
        if granted is not None and manifest.fence_token > granted:
            return Verdict(
                None,
                "fence",
                f"fencing token {manifest.fence_token} was never granted (the run's lease has granted up to {granted})",
            )
        return Verdict(manifest)

    def status(self) -> dict[str, Any]:
        """For /readyz and `slipstream status`."""
        out: dict[str, Any] = {
            "signatures": "required" if self.keyring else "off",
            "trusted_keys": self.keyring.ids,
            "verified": self.accepted,
            "refused": dict(self.refused),
        }
        if self.last_refused is not None:
            out["last_refused"] = self.last_refused
        return out
