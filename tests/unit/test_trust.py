"""Signed weight manifests: what a signature covers, the keyring, key rotation, and the announce verifier.

The verifier runs against a real local object store in a temporary directory; the check of
fencing tokens against Redis's granted counter is in tests/integration/test_control_redis.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from slipstream.schemas import ShardRef, TensorEntry, WeightAnnounce, WeightManifest, to_json
from slipstream.store import LocalObjectStore
from slipstream.trust import (
    AnnounceVerifier,
    BadKey,
    Check,
    Keyring,
    SigningKey,
    check_manifest,
    generate_keypair,
    key_id,
    load_signing_key,
    payload,
    sign_manifest,
)
from slipstream.trust.verifier import REFUSED

pytestmark = pytest.mark.unit

RUN = "run-a"


def _manifest(version: int = 3, *, fence_token: int = 7, run_id: str = RUN) -> WeightManifest:
    return WeightManifest(
        policy_version=version,
        base_version=version - 1,
        keyframe=False,
        run_id=run_id,
        shards=[ShardRef(key=f"weights/{run_id}/v{version}/shard-0000.bin", size=10, sha256="ab" * 32, codec="zstd")],
        tensors=[TensorEntry(name="w", dtype="bfloat16", shape=[2, 2], shard=0, offset=0, nbytes=8, encoding="xor")],
        raw_bytes=8,
        stored_bytes=10,
        created_at=1700000000.25,
        fence_token=fence_token,
    )


def _key() -> SigningKey:
    return SigningKey.of(Ed25519PrivateKey.generate())


def test_a_signed_manifest_checks_and_any_edit_breaks_it() -> None:
    key = _key()
    ring = Keyring.parse([key.public])
    signed = sign_manifest(_manifest(), key)
    assert signed.key_id == key.key_id and len(signed.key_id) == 16
    assert check_manifest(signed, ring) is Check.OK
    # It survives the store: JSON out and back in.
    assert check_manifest(msgspec.json.decode(to_json(signed), type=WeightManifest), ring) is Check.OK
    edits = {
        "version": msgspec.structs.replace(signed, policy_version=4),
        "fence": msgspec.structs.replace(signed, fence_token=99),
        "run": msgspec.structs.replace(signed, run_id="run-b"),
        "shard digest": msgspec.structs.replace(
            signed, shards=[msgspec.structs.replace(signed.shards[0], sha256="cd" * 32)]
        ),
        "tensor offset": msgspec.structs.replace(
            signed, tensors=[msgspec.structs.replace(signed.tensors[0], offset=1)]
        ),
        "base": msgspec.structs.replace(signed, base_version=0),
    }
    for what, edited in edits.items():
        assert check_manifest(edited, ring) is Check.BAD_SIGNATURE, what


def test_unsigned_foreign_and_garbled_signatures_are_told_apart() -> None:
    ours, theirs = _key(), _key()
    ring = Keyring.parse([ours.public])
    assert check_manifest(_manifest(), ring) is Check.UNSIGNED
    assert check_manifest(sign_manifest(_manifest(), theirs), ring) is Check.UNKNOWN_KEY
    # Their signature under our key id: it does not verify.
    forged = msgspec.structs.replace(sign_manifest(_manifest(), theirs), key_id=ours.key_id)
    assert check_manifest(forged, ring) is Check.BAD_SIGNATURE
    garbled = msgspec.structs.replace(sign_manifest(_manifest(), ours), ed25519="not base64!")
    assert check_manifest(garbled, ring) is Check.BAD_SIGNATURE


def test_the_payload_leaves_out_defaults_and_the_signature_fields() -> None:
    m = _manifest()
    body = json.loads(payload(m).split(b"\n", 1)[1])
    assert "key_id" not in body and "ed25519" not in body
    assert "signature" not in body  # "" is its default: a newer field at its default changes nothing
    assert body["fence_token"] == 7 and body["shards"][0]["codec"] == "zstd"
    assert (
        "codec"
        not in json.loads(
            payload(msgspec.structs.replace(m, shards=[ShardRef(key="k", size=1, sha256="")])).split(b"\n", 1)[1]
        )["shards"][0]
    )
    assert payload(m) == payload(sign_manifest(m, _key()))


def test_keys_rotate_through_the_keyring() -> None:
    old, new = _key(), _key()
    by_old, by_new = sign_manifest(_manifest(3), old), sign_manifest(_manifest(4), new)
    # 1. verifiers trust the old key only.
    ring = Keyring.parse([old.public])
    assert [check_manifest(m, ring) for m in (by_old, by_new)] == [Check.OK, Check.UNKNOWN_KEY]
    # 2. the new key is added everywhere: both verify while the publisher switches.
    ring = Keyring.parse([old.public, new.public])
    assert ring.ids == sorted([old.key_id, new.key_id])
    assert [check_manifest(m, ring) for m in (by_old, by_new)] == [Check.OK, Check.OK]
    # 3. the old key is removed: what it signed no longer passes.
    ring = Keyring.parse([new.public])
    assert [check_manifest(m, ring) for m in (by_old, by_new)] == [Check.UNKNOWN_KEY, Check.OK]


def test_keys_load_from_files_and_bad_ones_are_named(tmp_path: Path) -> None:
    key = generate_keypair(tmp_path / "k.pem")
    assert (tmp_path / "k.pem").stat().st_mode & 0o777 == 0o600
    assert load_signing_key(tmp_path / "k.pem").key_id == key.key_id
    pub = tmp_path / "k.pub.pem"
    pub.write_bytes(
        key.private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    assert Keyring.parse([str(pub)]).ids == Keyring.parse([key.public]).ids == [key_id(key.private.public_key())]
    with pytest.raises(FileExistsError):
        generate_keypair(tmp_path / "k.pem")  # never overwrites a key
    for entry, words in [
        ("ed25519:%%%", "not base64"),
        ("ed25519:AAAA", "3 bytes"),
        (str(tmp_path / "missing.pem"), "neither"),
        ("", "empty"),
    ]:
        with pytest.raises(BadKey, match=words):
            Keyring.parse([entry])
    (tmp_path / "junk.pem").write_text("hello")
    with pytest.raises(BadKey, match="not an unencrypted PEM private key"):
        load_signing_key(tmp_path / "junk.pem")
    with pytest.raises(BadKey, match="cannot read"):
        load_signing_key(tmp_path / "nope.pem")


# ---------------------------------------------------------------- the verifier


def _announce(m: WeightManifest, **over: object) -> WeightAnnounce:
    fields: dict[str, object] = {
        "policy_version": m.policy_version,
        "manifest_key": f"weights/{m.run_id}/v{m.policy_version:08d}/manifest.json",
        "run_id": m.run_id,
        "fence_token": m.fence_token,
    }
    fields.update(over)
    return WeightAnnounce(**fields)  # type: ignore[arg-type]


def _put(store: LocalObjectStore, m: WeightManifest) -> WeightAnnounce:
    a = _announce(m)
    store.put(a.manifest_key, to_json(m))
    return a


async def test_the_verifier_accepts_the_real_version_and_refuses_each_forgery(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "store")
    key, stranger = _key(), _key()
    verifier = AnnounceVerifier(store, run_id=RUN, keyring=Keyring.parse([key.public]))
    real = _put(store, sign_manifest(_manifest(3), key))
    assert (await verifier.verify(real)).ok

    tampered = sign_manifest(_manifest(4), key)
    tampered_announce = _put(store, msgspec.structs.replace(tampered, raw_bytes=9))
    other_run = sign_manifest(_manifest(6, run_id="run-b"), key)
    store.put("weights/elsewhere/manifest.json", to_json(other_run))
    cases = {
        "unsigned": _put(store, _manifest(5)),
        "unknown_key": _put(store, sign_manifest(_manifest(7), stranger)),
        "bad_signature": tampered_announce,
        "missing_manifest": _announce(_manifest(1000)),
        "fence": _announce(sign_manifest(_manifest(3), key), fence_token=99),
        "tampered": _announce(_manifest(6), manifest_key="weights/elsewhere/manifest.json"),
    }
    before = {reason: REFUSED.value(reason=reason) for reason in cases}
    for reason, announce in cases.items():
        verdict = await verifier.verify(announce)
        assert not verdict.ok and verdict.reason == reason, (reason, verdict)
        assert REFUSED.value(reason=reason) == before[reason] + 1
    assert verifier.refused == {reason: 1 for reason in cases}
    assert verifier.accepted == 1
    status = verifier.status()
    assert status["signatures"] == "required" and status["last_refused"]["reason"] == "tampered"
    # The real version is still accepted after every refusal: nothing was held back.
    assert (await verifier.verify(_put(store, sign_manifest(_manifest(8), key)))).ok


async def test_without_trusted_keys_signatures_are_not_asked_but_the_manifest_still_is(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "store")
    verifier = AnnounceVerifier(store, run_id=RUN, keyring=Keyring({}))
    assert (await verifier.verify(_put(store, _manifest(5)))).ok
    assert (await verifier.verify(_announce(_manifest(900)))).reason == "missing_manifest"
    assert verifier.status()["signatures"] == "off"


async def test_a_store_that_keeps_failing_is_unfetchable_within_the_budget(tmp_path: Path) -> None:
    class Broken(LocalObjectStore):
        def get(self, key: str) -> bytes:
            raise OSError("disk on fire")

    verifier = AnnounceVerifier(Broken(tmp_path / "s"), run_id=RUN, keyring=Keyring({}), timeout_s=0.3)
    verdict = await verifier.verify(_announce(_manifest(2)))
    assert verdict.reason == "unfetchable" and "disk on fire" in verdict.detail
