"""Ed25519 keys for weight manifests: the publisher's signing key and the verifiers' keyring.

A public key is named by its key id, the first 16 hex digits of the sha256 of its 32 raw bytes,
so a manifest says which key signed it without carrying the key. Keys are written as text:

- a private key: a PEM file (PKCS#8, unencrypted), the form `generate_keypair` writes and a
  Kubernetes Secret mounts;
- a public key: `ed25519:<base64 of the 32 raw bytes>` inline (the form config and ConfigMaps
  carry), or the path of a PEM file (SubjectPublicKeyInfo).

Rotation is done through the keyring alone: add the new public key to every verifier, switch
the publisher to the new private key, and once no version signed by the old key is needed any
more, remove the old public key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

INLINE_PREFIX = "ed25519:"
KEY_ID_HEX = 16


class BadKey(ValueError):
    """A key that cannot be read; the message names where it came from and what was wrong."""


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(key: Ed25519PublicKey) -> str:
    """The id a manifest names its signing key by: sha256 of the raw public key, 16 hex digits."""
    return hashlib.sha256(_raw_public(key)).hexdigest()[:KEY_ID_HEX]


def public_text(key: Ed25519PublicKey) -> str:
    """The inline form of a public key (`ed25519:<base64>`), for config files and env vars."""
    return INLINE_PREFIX + base64.b64encode(_raw_public(key)).decode()


@dataclass(frozen=True)
class SigningKey:
    """The publisher's private key and the id verifiers know it by."""

    private: Ed25519PrivateKey
    key_id: str

    @classmethod
    def of(cls, private: Ed25519PrivateKey) -> SigningKey:
        return cls(private, key_id(private.public_key()))

    def sign(self, payload: bytes) -> bytes:
        return self.private.sign(payload)

    @property
    def public(self) -> str:
        return public_text(self.private.public_key())


def load_signing_key(path: str | Path) -> SigningKey:
    """Read a PEM (PKCS#8) ed25519 private key; BadKey names the file and the problem."""
    p = Path(path).expanduser()
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise BadKey(f"signing key {p}: cannot read it ({exc.strerror or exc})") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise BadKey(f"signing key {p}: not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise BadKey(f"signing key {p}: a {type(key).__name__}, not an ed25519 private key")
    return SigningKey.of(key)


def parse_public_key(text: str) -> Ed25519PublicKey:
    """`ed25519:<base64>` or the path of a PEM public key; BadKey names the entry and the problem."""
    entry = text.strip()
    if not entry:
        raise BadKey("trusted key: empty entry")
    if entry.startswith(INLINE_PREFIX):
        body = entry[len(INLINE_PREFIX) :]
        try:
            raw = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise BadKey(f"trusted key {entry!r}: the part after 'ed25519:' is not base64") from None
        if len(raw) != 32:
            raise BadKey(f"trusted key {entry!r}: {len(raw)} bytes, an ed25519 public key has 32")
        return Ed25519PublicKey.from_public_bytes(raw)
    p = Path(entry).expanduser()
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise BadKey(
            f"trusted key {entry!r}: neither 'ed25519:<base64>' nor a readable PEM file ({exc.strerror or exc})"
        ) from None
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise BadKey(f"trusted key {p}: not a PEM public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise BadKey(f"trusted key {p}: a {type(key).__name__}, not an ed25519 public key")
    return key


class Keyring:
    """The public keys a verifier accepts, by key id."""

    def __init__(self, keys: Mapping[str, Ed25519PublicKey]) -> None:
        self._keys = dict(keys)

    @classmethod
    def parse(cls, entries: Iterable[str]) -> Keyring:
        keys: dict[str, Ed25519PublicKey] = {}
        for entry in entries:
            key = parse_public_key(entry)
            keys[key_id(key)] = key
        return cls(keys)

    @property
    def ids(self) -> list[str]:
        return sorted(self._keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def knows(self, kid: str) -> bool:
        return kid in self._keys

    def verify(self, kid: str, signature: bytes, payload: bytes) -> bool:
        """True when `signature` is `kid`'s signature of `payload` (False for an unknown id too)."""
        key = self._keys.get(kid)
        if key is None:
            return False
        try:
            key.verify(signature, payload)
        except InvalidSignature:
            return False
        return True


def generate_keypair(private_path: str | Path) -> SigningKey:
    """A fresh key written to `private_path` (PEM, mode 0600, created exclusively); the local stack's per-run key."""
    key = SigningKey.of(Ed25519PrivateKey.generate())
    pem = key.private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    p = Path(private_path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    return key
