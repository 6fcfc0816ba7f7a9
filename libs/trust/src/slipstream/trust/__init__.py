"""Who may announce weights: ed25519-signed manifests, the keyring of accepted keys, and the announce check.

- keys.py: signing keys, public keys (`ed25519:<base64>` or PEM), key ids, the keyring.
- signing.py: what a manifest signature covers; `sign_manifest`, `check_manifest`.
- verifier.py: `AnnounceVerifier`, run by every consumer of `weights.announce` before it acts.
- config.py: the `[trust]` config section.

Imports no torch, so the task source verifies announces without the weight codec.
"""

from slipstream.trust.config import TrustConfig
from slipstream.trust.keys import BadKey, Keyring, SigningKey, generate_keypair, key_id, load_signing_key, public_text
from slipstream.trust.signing import Check, check_manifest, payload, sign_manifest
from slipstream.trust.verifier import REASONS, AnnounceVerifier, Untrusted, Verdict

__all__ = [
    "REASONS",
    "AnnounceVerifier",
    "BadKey",
    "Check",
    "Keyring",
    "SigningKey",
    "TrustConfig",
    "Untrusted",
    "Verdict",
    "check_manifest",
    "generate_keypair",
    "key_id",
    "load_signing_key",
    "payload",
    "public_text",
    "sign_manifest",
]
