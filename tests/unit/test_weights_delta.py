"""The lossless delta codec: per-tensor XOR / sparse, the shard format, and version encode/decode.

Property tests draw raw bit patterns (NaN payloads, signed zeros and infinities included), so
"bit-exact" is checked on every pattern a dtype can hold, not only on values training produces.
"""

from __future__ import annotations

import hashlib
import io
import time

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.schemas import ShardRef, WeightManifest
from slipstream.weights import BaseMismatch, ShardFormatError, WeightsError, decode_version, encode_version, fingerprint
from slipstream.weights.container import pack_shard, read_shard
from slipstream.weights.delta import bits, sparse_apply, sparse_encode, sparse_nbytes, xor_into
from slipstream.weights.fingerprint import NO_FINGERPRINT
from slipstream.weights.snapshot import cut_shards
from slipstream.weights.workers import run_each, run_each_beside

pytestmark = pytest.mark.unit

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]
FAST = settings(
    max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _perturb(t: torch.Tensor, frac: float, seed: int) -> torch.Tensor:
    """A copy with about `frac` of the elements replaced by random bit patterns."""
    g = torch.Generator().manual_seed(seed)
    out = t.clone()
    flat = out.reshape(-1)
    mask = torch.rand(flat.numel(), generator=g) < frac
    repl = _random_bits((flat.numel(),), t.dtype, seed + 1)
    flat[mask] = repl[mask]
    return out


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert _raw(a[k]) == _raw(b[k]), f"tensor {k} differs"


def _manifest(coded, version: int, base: int | None) -> WeightManifest:
    refs = [
        ShardRef(key=f"v{version}/s{i}", size=len(d), sha256=hashlib.sha256(d).hexdigest(), codec="zstd")
        for i, d in enumerate(coded.shards)
    ]
    return WeightManifest(
        policy_version=version, base_version=base, keyframe=coded.keyframe, shards=refs, tensors=coded.tensors
    )


def _model(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": (torch.randn(300, 64, generator=g) * 0.02).to(dtype),
        "up": (torch.randn(64, 200, generator=g) * 0.02).to(dtype),
        "norm": torch.ones(64, dtype=dtype),
        "scalar": torch.tensor(0.5, dtype=dtype),
        "empty": torch.empty(0, 3, dtype=dtype),
    }


# ---------------------------------------------------------------- per-tensor primitives


@FAST
@given(dtype=st.sampled_from(DTYPES), n=st.integers(0, 3000), frac=st.floats(0, 1), seed=st.integers(0, 2**16))
def test_xor_is_its_own_inverse_on_every_bit_pattern(dtype: torch.dtype, n: int, frac: float, seed: int) -> None:
    base = _random_bits((n,), dtype, seed)
    new = _perturb(base, frac, seed + 7)
    delta = np.empty_like(bits(base))
    xor_into(bits(base), bits(new), delta)
    back = np.empty_like(delta)
    xor_into(bits(base), delta, back)
    assert back.tobytes() == _raw(new)
    assert int(np.count_nonzero(delta)) == int((bits(base) != bits(new)).sum())


@FAST
@given(dtype=st.sampled_from(DTYPES), n=st.integers(0, 3000), frac=st.floats(0, 1), seed=st.integers(0, 2**16))
def test_sparse_round_trips_and_has_the_predicted_size(dtype: torch.dtype, n: int, frac: float, seed: int) -> None:
    base = _random_bits((n,), dtype, seed)
    new = _perturb(base, frac, seed + 3)
    payload = sparse_encode(bits(base), bits(new))
    changed = int((bits(base) != bits(new)).sum())
    assert len(payload) == sparse_nbytes(changed, base.element_size())
    target = bits(base).copy()
    assert sparse_apply(target, payload) == changed
    assert target.tobytes() == _raw(new)


def test_sparse_payload_layout_is_gaps_then_values() -> None:
    base = np.zeros(10, np.uint16)
    new = base.copy()
    new[[2, 3, 9]] = [7, 8, 9]
    payload = sparse_encode(base, new)
    assert np.frombuffer(payload[:12], "<u4").tolist() == [2, 1, 6]
    assert np.frombuffer(payload[12:], np.uint16).tolist() == [7, 8, 9]


def test_sparse_apply_rejects_malformed_payloads() -> None:
    target = np.zeros(4, np.uint16)
    with pytest.raises(ValueError, match="whole number"):
        sparse_apply(target, b"\x00" * 7)
    out_of_range = np.array([5], "<u4").tobytes() + np.array([1], np.uint16).tobytes()
    with pytest.raises(ValueError, match="addresses element 5"):
        sparse_apply(target, out_of_range)
    assert target.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_run_each_returns_every_result_in_order_and_raises_the_first_error(threads: int) -> None:
    assert run_each(lambda i: i * i, 23, threads) == [i * i for i in range(23)]
    assert run_each(lambda i: i, 0, threads) == []
    seen: list[int] = []

    def boom(i: int) -> int:
        seen.append(i)
        time.sleep(0.001)  # lets the threads interleave, as real frames do
        if i == 3:
            raise KeyError("item 3")
        return i

    with pytest.raises(KeyError, match="item 3"):
        run_each(boom, 1000, threads)
    assert len(seen) < 1000  # the others stop taking items after a failure


@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize(("n_main", "n_side"), [(0, 0), (0, 2), (1, 2), (7, 2), (7, 0)])
def test_run_each_beside_keeps_main_and_side_results_apart_and_in_order(threads: int, n_main: int, n_side: int) -> None:
    started: list[str] = []

    def task(name: str, value: int):
        def run() -> int:
            started.append(name)
            return value

        return run

    main = [task(f"m{k}", k) for k in range(n_main)]
    side = [task(f"s{k}", -k - 1) for k in range(n_side)]
    got_main, got_side = run_each_beside(main, side, threads)
    assert got_main == list(range(n_main))
    assert got_side == [-k - 1 for k in range(n_side)]
    if threads == 1 and n_main >= n_side:
        # side task k is queued right behind main task k, so it starts long before the last frame
        assert started[: 2 * n_side] == [x for k in range(n_side) for x in (f"m{k}", f"s{k}")]


# ---------------------------------------------------------------- shard format


def test_shard_is_a_standard_zstd_stream_of_its_raw_payload() -> None:
    z = zstandard.ZstdCompressor(level=1)
    chunks = [b"a" * 1000, bytes(range(256)) * 3, b""]
    fp, base_fp = b"\x01" * 32, b"\x02" * 32
    shard = pack_shard(
        [z.compress(c) for c in chunks], [len(c) for c in chunks], fingerprint=fp, base_fingerprint=base_fp
    )
    table = read_shard(shard)
    assert table.raw_sizes == [1000, 768, 0] and table.raw_offsets == [0, 1000, 1768] and table.raw_size == 1768
    assert (table.fingerprint, table.base_fingerprint) == (fp, base_fp)
    # Any zstd decoder skips the table and yields the payload the TensorEntry offsets point into.
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(shard), read_across_frames=True)
    assert reader.read() == b"".join(chunks)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda b: b[:10], "too short"),
        (lambda b: b"\x00" + b[1:], "frame-table magic"),
        (lambda b: b[:8] + b"X" + b[9:], "tag"),
        (lambda b: b[:16] + b"\x07" + b[17:], "format 7"),
        (lambda b: b + b"extra", "frames add up"),
        (lambda b: b[:-1], "frames add up"),
    ],
)
def test_bad_shard_bytes_are_named(mutate, match: str) -> None:
    shard = pack_shard(
        [zstandard.ZstdCompressor().compress(b"x" * 100)], [100], fingerprint=bytes(32), base_fingerprint=bytes(32)
    )
    with pytest.raises(ShardFormatError, match=match):
        read_shard(mutate(shard), "weights/r/v1/shard-0000.bin")


# ---------------------------------------------------------------- whole versions


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 3])
def test_keyframe_and_delta_round_trip_bit_exact_for_every_dtype(dtype: torch.dtype, threads: int) -> None:
    base = {k: _random_bits(tuple(v.shape), dtype, i) for i, (k, v) in enumerate(_model(torch.float32).items())}
    new = {k: _perturb(v, 0.05, 100 + i) for i, (k, v) in enumerate(base.items())}
    key = encode_version(base, threads=threads, frame_bytes=4096, shard_bytes=20_000)
    assert key.keyframe and len(key.shards) > 1 and all(e.encoding == "full" for e in key.tensors)
    got_base = decode_version(_manifest(key, 0, None), key.shards, threads=threads)
    _same(got_base, base)
    delta = encode_version(new, base, threads=threads, frame_bytes=4096, shard_bytes=20_000)
    assert not delta.keyframe and delta.base_fingerprint == key.fingerprint
    got = decode_version(_manifest(delta, 1, 0), delta.shards, got_base, base_version=0, threads=threads)
    _same(got, new)
    assert delta.fingerprint == fingerprint(new)


@FAST
@given(
    shapes=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 300)), min_size=1, max_size=6),
    dtype=st.sampled_from(DTYPES),
    frac=st.sampled_from([0.0, 0.001, 0.05, 0.5, 1.0]),
    frame_bytes=st.sampled_from([4096, 8192, 1 << 20]),
    shard_bytes=st.integers(1, 60_000),
    threads=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_any_layout_round_trips_bit_exact(shapes, dtype, frac, frame_bytes, shard_bytes, threads, seed) -> None:
    base = {f"t{i}": _random_bits(s, dtype, seed + i) for i, s in enumerate(shapes)}
    new = {k: _perturb(v, frac, seed + 100 + i) for i, (k, v) in enumerate(base.items())}
    key = encode_version(base, frame_bytes=frame_bytes, shard_bytes=shard_bytes, threads=threads)
    _same(decode_version(_manifest(key, 0, None), key.shards, threads=threads), base)
    delta = encode_version(new, base, frame_bytes=frame_bytes, shard_bytes=shard_bytes, threads=threads)
    for e in delta.tensors:
        assert e.nbytes <= shard_bytes or all(o.shard != e.shard for o in delta.tensors if o is not e)
    _same(decode_version(_manifest(delta, 1, 0), delta.shards, base, base_version=0, threads=threads), new)


def test_training_like_delta_compresses_and_picks_sparse_only_where_it_is_smaller() -> None:
    base = _model(torch.bfloat16)
    new = dict(base)
    g = torch.Generator().manual_seed(5)
    # Dense small updates (like an optimizer step): most bf16 elements keep their bits.
    new["embed"] = (base["embed"].float() + 1e-5 * torch.randn(300, 64, generator=g)).to(torch.bfloat16)
    new["up"] = base["up"].clone()
    new["up"].view(-1)[[3, 999, 5000]] += 1.0  # three changed elements
    coded = encode_version(new, base, frame_bytes=4096)
    enc = {e.name: e for e in coded.tensors}
    assert enc["embed"].encoding == "xor"
    assert enc["up"].encoding == "sparse" and enc["up"].nbytes == sparse_nbytes(3, 2)
    assert enc["norm"].encoding == "sparse" and enc["norm"].nbytes == 0  # unchanged: nothing stored
    changed = int(sum((bits(base[k]) != bits(new[k])).sum() for k in base))
    assert coded.changed == changed
    assert coded.stored_bytes < coded.raw_bytes / 4
    forced_xor = encode_version(new, base, frame_bytes=4096, sparse=False)
    assert {e.encoding for e in forced_xor.tensors} == {"xor"}
    assert coded.stored_bytes < forced_xor.stored_bytes
    got = decode_version(_manifest(coded, 1, 0), coded.shards, base, base_version=0)
    _same(got, new)


def test_decode_in_place_writes_into_the_base_and_out_tensors() -> None:
    base = _model(torch.float32)
    new = {k: _perturb(v, 0.3, i) for i, (k, v) in enumerate(base.items())}
    coded = encode_version(new, base, frame_bytes=4096)
    m = _manifest(coded, 1, 0)
    held = {k: v.clone() for k, v in base.items()}
    ptrs = {k: v.data_ptr() for k, v in held.items()}
    got = decode_version(m, coded.shards, held, base_version=0, out=held)
    _same(held, new)
    assert {k: v.data_ptr() for k, v in got.items()} == ptrs  # no new memory for the model
    out = {k: torch.empty_like(v) for k, v in base.items()}
    with pytest.raises(ValueError, match="out tensor 'up'"):
        decode_version(m, coded.shards, base, out={**out, "up": torch.empty(3)})
    decode_version(m, coded.shards, base, out=out)
    _same(out, new)
    _same(base, _model(torch.float32))  # the base itself is untouched when out is elsewhere


def test_delta_on_the_wrong_base_is_refused_before_anything_is_written() -> None:
    v0 = _model(torch.bfloat16)
    v1 = {k: _perturb(v, 0.1, i) for i, (k, v) in enumerate(v0.items())}
    v2 = {k: _perturb(v, 0.1, 50 + i) for i, (k, v) in enumerate(v1.items())}
    coded = encode_version(v2, v1, frame_bytes=4096)
    m = _manifest(coded, 2, 1)
    wrong = {k: v.clone() for k, v in v0.items()}
    with pytest.raises(BaseMismatch, match="fingerprint"):
        decode_version(m, coded.shards, wrong, out=wrong)  # in place, yet nothing written
    _same(wrong, v0)
    with pytest.raises(BaseMismatch, match="the base given is 0"):
        decode_version(m, coded.shards, v1, base_version=0)
    with pytest.raises(BaseMismatch, match="a base is needed"):
        decode_version(m, coded.shards)
    with pytest.raises(BaseMismatch, match="'up'"):
        decode_version(m, coded.shards, {k: v for k, v in v1.items() if k != "up"})


def test_encode_refuses_a_base_with_other_tensors() -> None:
    base = _model(torch.float32)
    with pytest.raises(ValueError, match="'norm' is not in the base"):
        encode_version(base, {k: v for k, v in base.items() if k != "norm"})
    with pytest.raises(ValueError, match=r"its base torch\.bfloat16"):
        encode_version(base, {k: v.to(torch.bfloat16) for k, v in base.items()})
    with pytest.raises(ValueError, match="frame_bytes"):
        encode_version(base, frame_bytes=100)


def test_raw_snapshots_decode_through_the_same_entry_point() -> None:
    # (no 0-dim or empty tensor here: tensors.as_bytes_view, used by the raw path, fails on them)
    tensors = {k: v for k, v in _model(torch.bfloat16).items() if v.dim() and v.numel()}
    enc = cut_shards(tensors, 4096)
    refs = [ShardRef(key=f"s{i}", size=len(d), sha256="", codec="raw") for i, d in enumerate(enc.shards)]
    m = WeightManifest(policy_version=0, shards=refs, tensors=enc.tensors)
    _same(decode_version(m, enc.shards), tensors)


@FAST
@given(data=st.data())
def test_a_corrupted_frame_table_never_decodes_silently(data: st.DataObject) -> None:
    base = _model(torch.bfloat16)
    new = {k: _perturb(v, 0.1, i) for i, (k, v) in enumerate(base.items())}
    coded = encode_version(new, base, frame_bytes=4096)
    m = _manifest(coded, 1, 0)
    shard = bytearray(coded.shards[0])
    table_end = 8 + int.from_bytes(shard[4:8], "little")
    pos = data.draw(st.integers(0, table_end - 1), label="byte")
    shard[pos] ^= data.draw(st.integers(1, 255), label="xor")
    with pytest.raises(WeightsError):
        decode_version(m, [bytes(shard), *coded.shards[1:]], base, base_version=0)


def test_keyframe_records_no_base() -> None:
    coded = encode_version(_model(torch.float32))
    assert read_shard(coded.shards[0]).base_fingerprint == NO_FINGERPRINT
    assert coded.changed == coded.elements
