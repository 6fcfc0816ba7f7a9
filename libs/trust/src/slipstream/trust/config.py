"""The `[trust]` config section: the publisher's signing key and the keys every verifier accepts."""

from __future__ import annotations

from typing import Annotated

import msgspec

Doc = msgspec.Meta


class TrustConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`[trust]`: who may announce weights. Rotate: add the new public key, switch the signing key, drop the old."""

    signing_key: Annotated[
        str,
        Doc(description="Publisher: PEM (PKCS#8) ed25519 private key file that signs each manifest; empty = unsigned."),
    ] = ""
    trusted_keys: Annotated[
        list[str],
        Doc(
            description="Verifiers: accepted public keys, each 'ed25519:<base64>' or a PEM file path; with any set, "
            "unsigned versions and versions signed by any other key are refused (empty = signatures not checked)."
        ),
    ] = msgspec.field(default_factory=list)
    verify_timeout_s: Annotated[
        float,
        Doc(
            description="Longest time spent fetching one announced manifest (store errors retried); past it the "
            "announce is refused as unfetchable and later versions go on.",
            gt=0,
        ),
    ] = 5.0


class ProvenanceConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`[provenance]`: who may score episodes. Rotate: add the new public key to the learner, switch the
    reward-model's signing key, drop the old one."""

    signing_key: Annotated[
        str,
        Doc(
            description="Reward-model: PEM (PKCS#8) ed25519 private key file that signs each scored episode; "
            "empty = unsigned (a learner with trusted keys refuses them)."
        ),
    ] = ""
    trusted_keys: Annotated[
        list[str],
        Doc(
            description="Learner: accepted reward-model public keys, each 'ed25519:<base64>' or a PEM file path; "
            "with any set, a scored episode unsigned or signed by any other key is refused and counted, whoever "
            "published it (empty = signatures not checked)."
        ),
    ] = msgspec.field(default_factory=list)
