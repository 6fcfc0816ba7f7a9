"""Who may announce weights and score episodes: ed25519 signatures, the keyring of accepted keys, the checks.

- keys.py: signing keys, public keys (`ed25519:<base64>` or PEM), key ids, the keyring.
- signing.py: what a manifest signature covers; `sign_manifest`, `check_manifest`.
- verifier.py: `AnnounceVerifier`, run by every consumer of `weights.announce` before it acts.
- scores.py: signed scored episodes (`sign_scored`, `check_scored`, the learner's `ScoreVerifier`).
- config.py: the `[trust]` and `[provenance]` config sections.

Imports no torch, so the task source verifies announces without the weight codec.
"""

from slipstream.trust.config import ProvenanceConfig, TrustConfig
from slipstream.trust.keys import BadKey, Keyring, SigningKey, generate_keypair, key_id, load_signing_key, public_text
from slipstream.trust.scores import ScoreVerifier, check_scored, score_payload, sign_scored
from slipstream.trust.signing import Check, check_manifest, payload, sign_manifest
from slipstream.trust.verifier import REASONS, AnnounceVerifier, Untrusted, Verdict

__all__ = [
    "REASONS",
    "AnnounceVerifier",
    "BadKey",
    "Check",
    "Keyring",
    "ProvenanceConfig",
    "ScoreVerifier",
    "SigningKey",
    "TrustConfig",
    "Untrusted",
    "Verdict",
    "check_manifest",
    "check_scored",
    "generate_keypair",
    "key_id",
    "load_signing_key",
    "payload",
    "public_text",
    "score_payload",
    "sign_manifest",
    "sign_scored",
]
