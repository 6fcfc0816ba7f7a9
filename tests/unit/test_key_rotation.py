"""Key rotation through config, end to end through the weight codec.

The publisher's store (`VersionStore`) signs versions 0-2 with the old key, is restarted with the
new key and signs 3-5 (version 4 is a keyframe). Verifiers rotate by their `[trust]
trusted_keys` alone: with both keys every version loads; with only the new key, versions whose
chain still runs through the old key's keyframe are refused (which is why the old key stays
until a keyframe signed by the new one exists), and from that keyframe on everything loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from slipstream.eval_gate.evaluator import Unloadable, fetch_weights
from slipstream.schemas import WeightAnnounce
from slipstream.store import LocalObjectStore
from slipstream.trust import AnnounceVerifier, Keyring, SigningKey, TrustConfig, Untrusted
from slipstream.weight_publisher.codec import VersionStore
from slipstream.weights.chain import load_version

pytestmark = pytest.mark.unit
RUN = "rotate"


def _tensors(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {"w": torch.randn(8, 8, generator=g).to(torch.bfloat16), "b": torch.full((8,), float(version))}


def _keyring(*keys: SigningKey) -> Keyring:
    # As a verifier builds it from its config: [trust] trusted_keys = ["ed25519:...", ...].
    return Keyring.parse(TrustConfig(trusted_keys=[k.public for k in keys]).trusted_keys)


async def test_keys_rotate_by_config_without_refusing_a_real_version(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "store")
    old, new = SigningKey.of(Ed25519PrivateKey.generate()), SigningKey.of(Ed25519PrivateKey.generate())

    def publisher(key: SigningKey) -> VersionStore:
        return VersionStore(store, run_id=RUN, shard_bytes=1 << 20, keyframe_every=4, threads=1, signing_key=key)

    stored = {}
    first = publisher(old)
    for v in range(3):
        stored[v] = first.store_version(version=v, load=lambda v=v: _tensors(v), step_finished_at=0.0, fence_token=2)
    second = publisher(new)  # the publisher restarted with [trust] signing_key = the new key
    for v in range(3, 6):
        stored[v] = second.store_version(version=v, load=lambda v=v: _tensors(v), step_finished_at=0.0, fence_token=2)
    assert [stored[v].manifest.key_id for v in range(6)] == [old.key_id] * 3 + [new.key_id] * 3
    assert [stored[v].manifest.keyframe for v in range(6)] == [True, False, False, False, True, False]

    def announce(v: int) -> WeightAnnounce:
        return WeightAnnounce(policy_version=v, manifest_key=stored[v].manifest_key, run_id=RUN, fence_token=2)

    # Step 1 of a rotation: verifiers trust both keys. Every version is accepted and loads bit-exact.
    both = AnnounceVerifier(store, run_id=RUN, keyring=_keyring(old, new))
    for v in range(6):
        assert (await both.verify(announce(v))).ok, v
        loaded = load_version(store, RUN, v, check=both.check_chain_manifest)
        assert all(torch.equal(loaded[n], t) for n, t in _tensors(v).items()), v

    # Step 2: the old key is dropped. Its versions are refused as unknown_key; version 3 is signed
    # by the new key but its delta chain runs through the old key's keyframe, so loading it fails.
    only_new = AnnounceVerifier(store, run_id=RUN, keyring=_keyring(new))
    assert (await only_new.verify(announce(1))).reason == "unknown_key"
    assert (await only_new.verify(announce(3))).ok
    with pytest.raises(Untrusted, match="unknown_key"):
        load_version(store, RUN, 3, check=only_new.check_chain_manifest)
    # From the new key's keyframe on, nothing of the old key is needed.
    for v in (4, 5):
        loaded = load_version(store, RUN, v, check=only_new.check_chain_manifest)
        assert torch.equal(loaded["w"], _tensors(v)["w"])

    # The eval gate loads candidates and baselines the same way: an untrusted chain is Unloadable.
    with pytest.raises(Unloadable, match="unknown_key"):
        fetch_weights(store, stored[3].manifest_key, RUN, only_new.check_chain_manifest)
    manifest, tensors = fetch_weights(store, stored[5].manifest_key, RUN, only_new.check_chain_manifest)
    assert manifest.policy_version == 5 and torch.equal(tensors["w"], _tensors(5)["w"])
