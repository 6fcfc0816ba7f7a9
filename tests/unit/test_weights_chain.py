"""Version chains in a local object store: keyframes, deltas, catch-up, and shards that go bad.

The long test trains a small Llama with real AdamW steps and publishes 50 consecutive versions
(bf16 and fp32): a worker that follows every version, a late joiner and a worker that missed
versions must all hold exactly the published bits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.engine import ModelConfig, build_tiny
from slipstream.store import LocalObjectStore
from slipstream.weights import (
    CorruptShard,
    VersionExists,
    WeightsError,
    apply_chain,
    fetch_verified,
    is_keyframe_version,
    latest_version,
    load_version,
    manifest_key,
    publish_snapshot,
    publish_version,
    read_manifest,
    resolve_chain,
)
from slipstream.weights.chain import BASE_FALLBACKS, SHARD_FAILURES

pytestmark = pytest.mark.unit

RUN = "r"
SMALL = ModelConfig(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=259,
    max_position_embeddings=64,
)


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and _raw(a[k]) == _raw(b[k]) for k in a)


def _versions(n: int, dtype: torch.dtype, lr: float = 1e-4) -> list[dict[str, torch.Tensor]]:
    """`n` consecutive snapshots (in `dtype`) of a small model trained by AdamW on random tokens."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 100k-parameter model: more threads only spin against each other
    try:
        return _train(n, dtype, lr)
    finally:
        torch.set_num_threads(threads)


def _train(n: int, dtype: torch.dtype, lr: float) -> list[dict[str, torch.Tensor]]:
    model, _ = build_tiny(SMALL, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        out.append({k: v.detach().to(dtype).clone() for k, v in model.state_dict().items()})
        x = torch.randint(0, SMALL.vocab_size, (2, 17), generator=gen)
        loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, SMALL.vocab_size), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return out


def _publish_all(store: LocalObjectStore, versions: list[dict[str, torch.Tensor]], keyframe_every: int) -> list:
    pubs = []
    for v, tensors in enumerate(versions):
        base = None if v == 0 else (v - 1, versions[v - 1])
        pubs.append(
            publish_version(
                store,
                run_id=RUN,
                version=v,
                tensors=tensors,
                base=base,
                keyframe_every=keyframe_every,
                frame_bytes=16384,
                shard_bytes=64 * 1024,
                threads=2,
            )
        )
    return pubs


@pytest.fixture
def store(tmp_path: Path) -> LocalObjectStore:
    return LocalObjectStore(tmp_path / "store")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fifty_adamw_versions_decode_bit_exact_with_catch_up(store: LocalObjectStore, dtype: torch.dtype) -> None:
    versions = _versions(50, dtype)
    pubs = _publish_all(store, versions, keyframe_every=10)
    assert [p.manifest.keyframe for p in pubs] == [v % 10 == 0 for v in range(50)]
    assert all(p.manifest.base_version == (None if v % 10 == 0 else v - 1) for v, p in enumerate(pubs))
    assert len(pubs[0].manifest.shards) > 1  # the shard bound cut the model
    deltas = [p.manifest.stored_bytes for p in pubs if not p.manifest.keyframe]
    keyframes = [p.manifest.stored_bytes for p in pubs if p.manifest.keyframe]
    assert max(deltas) < min(keyframes)
    assert latest_version(store, RUN) == 49

    # A worker that follows every announce applies one delta at a time onto what it holds,
    # decoding into the memory of the version it held before that (as the rollout worker does).
    held = load_version(store, RUN, 0)
    assert _same(held, versions[0])
    spare = None
    for v in range(1, 50):
        chain = resolve_chain(store, RUN, v, v - 1)
        assert [m.policy_version for m in chain] == [v]
        held, spare = load_version(store, RUN, v, have=(v - 1, held), spare=spare), held
        assert _same(held, versions[v]), f"version {v} is not bit-exact"

    # A late joiner starts from the latest keyframe at or before the target.
    assert [m.policy_version for m in resolve_chain(store, RUN, 37)] == list(range(30, 38))
    assert _same(load_version(store, RUN, 37), versions[37])
    # A worker that missed versions: its base is not on the target's chain, so keyframe + deltas.
    assert [m.policy_version for m in resolve_chain(store, RUN, 45, 12)] == list(range(40, 46))
    assert _same(load_version(store, RUN, 45, have=(12, versions[12])), versions[45])
    # Within the same keyframe interval only the deltas after the held version are fetched.
    assert [m.policy_version for m in resolve_chain(store, RUN, 48, 41)] == list(range(42, 49))
    assert _same(load_version(store, RUN, 48, have=(41, versions[41]), inplace=True), versions[48])
    assert resolve_chain(store, RUN, 20, 20) == []


def test_lower_learning_rate_makes_smaller_deltas(store: LocalObjectStore) -> None:
    sizes = {}
    for lr in (1e-4, 1e-6):
        versions = _versions(4, torch.bfloat16, lr=lr)
        run = f"lr{lr:g}"
        publish_version(store, run_id=run, version=0, tensors=versions[0])
        pub = publish_version(store, run_id=run, version=1, tensors=versions[1], base=(0, versions[0]))
        assert not pub.manifest.keyframe and pub.manifest.raw_bytes == sum(t.nbytes for t in versions[1].values())
        sizes[lr] = pub.manifest.stored_bytes
    assert sizes[1e-6] < sizes[1e-4] / 2


def test_keyframes_come_on_schedule_or_when_the_base_cannot_serve(store: LocalObjectStore) -> None:
    versions = _versions(4, torch.bfloat16)
    assert is_keyframe_version(0, 3) and is_keyframe_version(6, 3) and not is_keyframe_version(4, 3)
    publish_version(store, run_id=RUN, version=0, tensors=versions[0])
    # Base version 5 was never stored: a delta on it could not be resolved, so a keyframe.
    assert publish_version(store, run_id=RUN, version=7, tensors=versions[1], base=(5, versions[0])).manifest.keyframe
    # A base with other tensors cannot carry a delta either.
    smaller = {k: v for i, (k, v) in enumerate(versions[0].items()) if i}
    assert publish_version(store, run_id=RUN, version=8, tensors=versions[2], base=(0, smaller)).manifest.keyframe
    delta = publish_version(store, run_id=RUN, version=9, tensors=versions[3], base=(8, versions[2]))
    assert (delta.manifest.keyframe, delta.manifest.base_version) == (False, 8)
    with pytest.raises(VersionExists, match="version 9"):
        publish_version(store, run_id=RUN, version=9, tensors=versions[3], base=(8, versions[2]))
    with pytest.raises(ValueError, match="older"):
        publish_version(store, run_id=RUN, version=10, tensors=versions[3], base=(10, versions[3]))


def test_a_raw_snapshot_can_start_a_chain(store: LocalObjectStore) -> None:
    versions = _versions(3, torch.bfloat16)
    publish_snapshot(store, run_id=RUN, version=0, tensors=versions[0])
    publish_version(store, run_id=RUN, version=1, tensors=versions[1], base=(0, versions[0]))
    publish_version(store, run_id=RUN, version=2, tensors=versions[2], base=(1, versions[1]))
    assert _same(load_version(store, RUN, 2), versions[2])


def test_a_held_copy_that_is_not_its_version_falls_back_to_the_keyframe(store: LocalObjectStore) -> None:
    versions = _versions(4, torch.bfloat16)
    _publish_all(store, versions, keyframe_every=10)
    claimed = {k: v.clone() for k, v in versions[1].items()}  # says "version 2", holds version 1
    before = BASE_FALLBACKS.value()
    got = load_version(store, RUN, 3, have=(2, claimed), inplace=True)
    assert _same(got, versions[3])
    assert BASE_FALLBACKS.value() == before + 1
    assert _same(claimed, versions[1])  # refused before a byte was written


def test_a_broken_chain_is_an_error(store: LocalObjectStore) -> None:
    versions = _versions(3, torch.bfloat16)
    _publish_all(store, versions, keyframe_every=10)
    store.delete(manifest_key(RUN, 0))
    with pytest.raises(WeightsError, match="not found"):
        resolve_chain(store, RUN, 2)
    assert [m.policy_version for m in resolve_chain(store, RUN, 2, 1)] == [2]


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("chain")
    store = LocalObjectStore(root / "store")
    versions = _versions(3, torch.bfloat16)
    pubs = _publish_all(store, versions, keyframe_every=10)
    return root, versions, pubs


@settings(max_examples=30, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_flipped_byte_in_any_shard_is_detected_and_never_applied(published, data: st.DataObject) -> None:
    root, versions, pubs = published
    store = LocalObjectStore(root / "store")
    version = data.draw(st.sampled_from([0, 2]), label="version")  # a keyframe and a delta
    manifest = pubs[version].manifest
    ref = data.draw(st.sampled_from(manifest.shards), label="shard")
    good = store.get(ref.key)
    pos = data.draw(st.integers(0, len(good) - 1), label="byte")
    bad = bytearray(good)
    bad[pos] ^= data.draw(st.integers(1, 255), label="xor")
    store.put(ref.key, bytes(bad))
    try:
        held = {k: v.clone() for k, v in versions[1].items()}
        before = SHARD_FAILURES.value(reason="corrupt")
        with pytest.raises(CorruptShard, match=ref.key):
            fetch_verified(store, manifest, attempts=2, retry_delay_s=0)
        assert SHARD_FAILURES.value(reason="corrupt") == before + 2
        chain = resolve_chain(store, RUN, version, 1 if version == 2 else None)
        with pytest.raises(CorruptShard):
            apply_chain(store, chain, held, base_version=1, inplace=True, attempts=1)
        assert _same(held, versions[1])  # the worker stays on the version it had
    finally:
        store.put(ref.key, good)
    assert _same(load_version(store, RUN, 2, have=(1, versions[1])), versions[2])


class _Flaky(LocalObjectStore):
    """Serves a corrupted copy of one key the first `bad` times it is read (a torn read, say)."""

    def __init__(self, root: Path, key: str, bad: int) -> None:
        super().__init__(root)
        self.key, self.bad = key, bad

    def get(self, key: str) -> bytes:
        data = super().get(key)
        if key == self.key and self.bad > 0:
            self.bad -= 1
            return data[:-1] + bytes([data[-1] ^ 1])
        return data


def test_a_shard_that_reads_bad_once_is_fetched_again(tmp_path: Path) -> None:
    versions = _versions(2, torch.bfloat16)
    store = LocalObjectStore(tmp_path / "store")
    pubs = _publish_all(store, versions, keyframe_every=10)
    flaky = _Flaky(tmp_path / "store", pubs[1].manifest.shards[0].key, bad=1)
    before = SHARD_FAILURES.value(reason="corrupt")
    got = load_version(flaky, RUN, 1, have=(0, versions[0]))
    assert _same(got, versions[1])
    assert SHARD_FAILURES.value(reason="corrupt") == before + 1
    flaky.bad = 5
    with pytest.raises(CorruptShard):
        load_version(flaky, RUN, 1, have=(0, versions[0]), attempts=3)
    assert flaky.bad == 2  # exactly `attempts` reads of the bad shard, then it gave up


def test_a_missing_shard_fails_after_bounded_attempts(tmp_path: Path) -> None:
    versions = _versions(2, torch.bfloat16)
    store = LocalObjectStore(tmp_path / "store")
    pubs = _publish_all(store, versions, keyframe_every=10)
    manifest = read_manifest(store, pubs[1].key)
    store.delete(manifest.shards[-1].key)
    before = SHARD_FAILURES.value(reason="missing")
    with pytest.raises(WeightsError, match="missing shard"):
        fetch_verified(store, manifest, attempts=3, retry_delay_s=0)
    assert SHARD_FAILURES.value(reason="missing") == before + 3


def _ptrs(tensors: dict[str, torch.Tensor]) -> set[int]:
    return {t.data_ptr() for t in tensors.values()}


def test_a_spare_version_is_decoded_into_only_when_it_fits_and_is_not_the_base(store: LocalObjectStore) -> None:
    versions = _versions(4, torch.bfloat16)
    _publish_all(store, versions, keyframe_every=10)
    held = load_version(store, RUN, 0)
    spare = load_version(store, RUN, 1)

    got = load_version(store, RUN, 2, have=(1, spare), spare=held)
    assert _same(got, versions[2])
    assert _ptrs(got) == _ptrs(held)  # written over the spare: no fresh memory
    assert _same(spare, versions[1])  # the base is untouched

    # A spare that is the base, overlaps it, or does not match the version is not used.
    base = {k: v.clone() for k, v in versions[2].items()}
    for bad in (base, {**held, "model.norm.weight": base["model.norm.weight"]}, {"x": torch.empty(3)}):
        before = {k: v.clone() for k, v in bad.items()}
        got = load_version(store, RUN, 3, have=(2, base), spare=bad)
        assert _same(got, versions[3])
        assert not _ptrs(got) & _ptrs(bad)
        assert _same(bad, before)
    # A keyframe chain (no base) decodes into the spare too.
    got = load_version(store, RUN, 3, spare=held)
    assert _same(got, versions[3]) and _ptrs(got) == _ptrs(held)


def test_a_wrong_base_is_refused_when_decoding_into_a_spare(store: LocalObjectStore) -> None:
    versions = _versions(3, torch.bfloat16)
    pubs = _publish_all(store, versions, keyframe_every=10)
    wrong = {k: v.clone() for k, v in versions[0].items()}
    spare = {k: torch.zeros_like(v) for k, v in versions[0].items()}
    chain = [pubs[2].manifest]
    with pytest.raises(WeightsError, match="fingerprint differs"):
        apply_chain(store, chain, wrong, base_version=1, spare=spare)
    assert _same(wrong, versions[0])  # the base is never written
    # load_version falls back to the keyframe chain and still lands on the exact bits.
    assert _same(load_version(store, RUN, 2, have=(1, wrong), spare=spare), versions[2])
