"""Signed scores: the reward-model signs every scored episode, the learner trains only on signed ones.

Bus permissions decide who may publish on `traj.scored.>`; they cannot tell a reward-model from
an administrator, or from anyone holding either's credentials. The signature is the second fence
(DESIGN.md, "Nothing trains without its producer's signature"): the reward-model signs each
`ScoredEpisode` it publishes with its own ed25519 key, and the learner refuses, acks and counts
any episode whose signature is missing, made by a key it does not trust, or does not match the
content, whoever published it.

What is signed is the canonical JSON form of the scored episode as published (`signing.canonical`:
default-valued fields left out, struct fields and dict keys sorted), less the two fields that
carry the signature, after a domain prefix of its own, so a manifest signature is never a valid
score signature and a score signed by an older reward-model still checks after the schema gains
fields. A by-reference episode is signed as its stub, whose sha256 binds the stored body.

Rotation goes through the keyring as for weights (`keys.py`): add the new public key to the
learner, switch the reward-model's signing key, drop the old key once nothing it signed is
still in the stream.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec

from slipstream.schemas import ScoredEpisode
from slipstream.telemetry.logs import get_logger
from slipstream.telemetry.metrics import counter
from slipstream.trust.keys import Keyring, SigningKey
from slipstream.trust.signing import Check, canonical, check_struct, sign_struct

DOMAIN = b"slipstream.traj.scored/1\n"
"""Prefix of every signed score payload (distinct from the manifests' `signing.DOMAIN`)."""
_UNSIGNED_FIELDS = frozenset({"key_id", "ed25519"})

log = get_logger(__name__)
REFUSED = counter(
    "scores/provenance/refused",
    "Scored episodes refused before intake: signature missing, by an untrusted key, or not matching (label reason).",
)


def score_payload(scored: ScoredEpisode) -> bytes:
    """The bytes a scored episode's signature is made over (see the module docstring)."""
    body = {k: v for k, v in canonical(scored).items() if k not in _UNSIGNED_FIELDS}
    return DOMAIN + msgspec.json.encode(body, order="sorted")


def sign_scored(scored: ScoredEpisode, key: SigningKey) -> ScoredEpisode:
    """`scored` with `key_id` and `ed25519` filled in by `key`."""
    return sign_struct(scored, key, score_payload)


def check_scored(scored: ScoredEpisode, keyring: Keyring) -> Check:
    """Whether `scored` carries a valid signature by a key of `keyring`."""
    return check_struct(scored, keyring, score_payload)


class ScoreVerifier:
    """The learner's check of each scored episode; counts what it refuses by reason."""

    def __init__(self, keyring: Keyring) -> None:
        self.keyring = keyring
        self.refused: Counter[str] = Counter()
        self.verified = 0
        if not keyring:
            log.warning("no [provenance] trusted_keys: scored episodes are trained without checking their signature")

    def refusal(self, scored: ScoredEpisode) -> tuple[str, str] | None:
        """None when `scored` may go on (or no keyring is set), else (reason, detail); a refusal is counted."""
        if not self.keyring:
            return None
        outcome = check_scored(scored, self.keyring)
        if outcome is Check.OK:
            self.verified += 1
            return None
        detail = {
            Check.UNSIGNED: "the scored episode carries no signature",
            Check.UNKNOWN_KEY: f"signed by key {scored.key_id!r}, not one of the trusted {self.keyring.ids}",
            Check.BAD_SIGNATURE: f"the signature by key {scored.key_id!r} does not match the scored episode",
        }[outcome]
        self.refused[outcome.value] += 1
        REFUSED.add(1, reason=outcome.value)
        log.warning("scored episode refused", episode_id=scored.episode.episode_id, reason=outcome.value, detail=detail)
        return outcome.value, detail

    def status(self) -> dict[str, Any]:
        """For /readyz and `slipstream status`."""
        return {
            "signatures": "required" if self.keyring else "off",
            "trusted_keys": self.keyring.ids,
            "verified": self.verified,
            "refused": dict(self.refused),
        }
