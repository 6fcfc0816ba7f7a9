"""Signed weight manifests: what is signed, how the publisher signs, how a verifier checks.

The signature covers every field of the manifest but the two that carry it (`key_id` and
`ed25519`), the shard list and tensor table included, so a manifest cannot be edited (another
shard digest, another version, another fence token, another run) without the signature failing.
What is signed is a canonical JSON form, not the stored bytes: fields at their default are left
out and keys are sorted, so a verifier whose schema gained fields since (append-only, with
defaults) computes the same bytes as the publisher did, and a field it does not know (a newer
publisher's, with a non-default value) makes the check fail rather than pass unseen.
"""

from __future__ import annotations

import base64
import binascii
import enum
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from slipstream.schemas import WeightManifest
from slipstream.trust.keys import Keyring, SigningKey

DOMAIN = b"slipstream.weights.manifest/1\n"
"""Prefix of every signed payload, so a manifest signature is never valid for anything else."""
_UNSIGNED_FIELDS = frozenset({"key_id", "ed25519"})


class Check(enum.Enum):
    """The outcome of checking one manifest's signature."""

    OK = "ok"
    UNSIGNED = "unsigned"
    UNKNOWN_KEY = "unknown_key"
    BAD_SIGNATURE = "bad_signature"


def canonical(value: Any) -> Any:
    """`value` as plain data with every struct's default-valued fields left out and its fields sorted."""
    if isinstance(value, msgspec.Struct):
        out: dict[str, Any] = {}
        for f in msgspec.structs.fields(value):
            v = getattr(value, f.encode_name)
            default = f.default if f.default is not msgspec.NODEFAULT else msgspec.NODEFAULT
            if f.default_factory is not msgspec.NODEFAULT:
                default = f.default_factory()
            if default is not msgspec.NODEFAULT and v == default:
                continue
            out[f.encode_name] = canonical(v)
        return dict(sorted(out.items()))
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    return value


def payload(manifest: WeightManifest) -> bytes:
    """The bytes a manifest's signature is made over (see the module docstring)."""
    body = {k: v for k, v in canonical(manifest).items() if k not in _UNSIGNED_FIELDS}
    return DOMAIN + msgspec.json.encode(body)


S = TypeVar("S", bound=msgspec.Struct)


def sign_struct(obj: S, key: SigningKey, payload_of: Callable[[S], bytes]) -> S:
    """`obj` (a struct with `key_id` and `ed25519` fields) signed by `key` over `payload_of(obj)`
    taken with both fields empty."""
    unsigned = msgspec.structs.replace(obj, key_id="", ed25519="")
    signature = key.sign(payload_of(unsigned))
    return msgspec.structs.replace(unsigned, key_id=key.key_id, ed25519=base64.b64encode(signature).decode())


def check_struct(obj: S, keyring: Keyring, payload_of: Callable[[S], bytes]) -> Check:
    """Whether `obj` carries a valid signature over `payload_of(obj)` by a key of `keyring`."""
    key_id, encoded = obj.key_id, obj.ed25519  # type: ignore[attr-defined]
    if not key_id and not encoded:
        return Check.UNSIGNED
    if not keyring.knows(key_id):
        return Check.UNKNOWN_KEY
    try:
        signature = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        return Check.BAD_SIGNATURE
    if not keyring.verify(key_id, signature, payload_of(obj)):
        return Check.BAD_SIGNATURE
    return Check.OK


def sign_manifest(manifest: WeightManifest, key: SigningKey) -> WeightManifest:
    """`manifest` with `key_id` and `ed25519` filled in by `key`."""
    return sign_struct(manifest, key, payload)


def check_manifest(manifest: WeightManifest, keyring: Keyring) -> Check:
    """Whether `manifest` carries a valid signature by a key of `keyring`."""
    return check_struct(manifest, keyring, payload)
