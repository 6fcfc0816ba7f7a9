"""Contract suite for the object store: one set of tests, run against every backend.

`local` runs over a tmp directory; `s3` over moto's S3 API server on a real loopback port
(the session fixture `s3_server`), with a fresh bucket per test and a key prefix, so the
prefix handling is exercised too. Backend-specific checks (atomic temp+rename on disk,
multipart ETags and ETag-pinned ranged reads on S3) follow the shared ones.
"""

from __future__ import annotations

import array
import os
import random
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from slipstream.stack import Server
from slipstream.store import (
    BucketNotFound,
    LocalObjectStore,
    ObjectNotFound,
    ObjectStore,
    StoreConfig,
    parse_s3_url,
    setup_store,
)
from slipstream.store.key import TEMP_PREFIX
from slipstream.store.transfer import BYTES, SECONDS

pytestmark = pytest.mark.contract

MiB = 1024 * 1024
BACKENDS = ["local", "s3"]


def _rand(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Dummy credentials, and nothing from the developer's own AWS setup."""
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))


def _config(backend: str, tmp_path: Path, s3_url: str = "", bucket: str = "", prefix: str = "run-1") -> StoreConfig:
    common = {"max_concurrency": 4, "multipart_threshold": 5 * MiB, "multipart_chunksize": 5 * MiB}
    if backend == "local":
        return StoreConfig(type="local", root=str(tmp_path / "store"), **common)  # type: ignore[arg-type]
    return StoreConfig(
        type="s3",
        url=f"s3://{bucket}/{prefix}",
        endpoint_url=s3_url,
        create_bucket=True,
        addressing_style="path",
        **common,  # type: ignore[arg-type]
    )


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ObjectStore]:
    if backend == "s3":
        server: Server = request.getfixturevalue("s3_server")
        request.getfixturevalue("aws_env")
        cfg = _config("s3", tmp_path, server.url, bucket=f"t-{uuid.uuid4().hex[:16]}")
    else:
        cfg = _config("local", tmp_path)
    s = setup_store(cfg)
    yield s
    s.close()


# -- the shared contract ---------------------------------------------------------------------


def test_round_trip_bytes_memoryview_and_empty(store: ObjectStore) -> None:
    assert isinstance(store, ObjectStore)
    data = _rand(10_000, 1)
    store.put("a/bytes.bin", data)
    assert store.get("a/bytes.bin") == data

    store.put("a/view.bin", memoryview(data)[100:1100])
    assert store.get("a/view.bin") == data[100:1100]
    assert store.size("a/view.bin") == 1000

    store.put("a/bytearray.bin", bytearray(b"xyz"))
    assert store.get("a/bytearray.bin") == b"xyz"

    # A typed buffer is stored as its raw bytes, not as len() elements.
    floats = array.array("d", [1.5, -2.0, 3.25])
    store.put("a/floats.bin", memoryview(floats))
    assert store.size("a/floats.bin") == 24
    assert array.array("d", store.get("a/floats.bin")) == floats

    with pytest.raises(ValueError, match="C-contiguous"):
        store.put("a/strided", memoryview(data)[::2])
    with pytest.raises(TypeError, match="bytes, bytearray or memoryview"):
        store.put("a/str", "text")  # type: ignore[arg-type]
    assert not store.exists("a/strided")

    store.put("a/empty", b"")
    assert store.get("a/empty") == b""
    assert store.size("a/empty") == 0
    assert store.exists("a/empty")


def test_overwrite_replaces_content(store: ObjectStore) -> None:
    store.put("k", b"a much longer first version")
    store.put("k", b"short")
    assert store.get("k") == b"short"
    assert store.size("k") == 5
    assert store.list() == ["k"]


def test_missing_key_errors_name_the_key(store: ObjectStore, tmp_path: Path) -> None:
    with pytest.raises(ObjectNotFound) as err:
        store.get("no/such.bin")
    assert isinstance(err.value, KeyError)
    assert err.value.key == "no/such.bin"
    assert "'no/such.bin'" in str(err.value)
    assert str(err.value).startswith("object not found")
    with pytest.raises(ObjectNotFound):
        store.size("no/such.bin")
    with pytest.raises(ObjectNotFound):
        store.get_range("no/such.bin", 0, 10)
    with pytest.raises(ObjectNotFound):
        store.get_range("no/such.bin", 0, 0)
    dest = tmp_path / "out" / "missing.bin"
    with pytest.raises(ObjectNotFound):
        store.get_file("no/such.bin", dest)
    assert not dest.exists()
    assert not dest.parent.exists() or list(dest.parent.iterdir()) == []
    store.put("present", b"1")
    with pytest.raises(ObjectNotFound) as many:
        store.get_many(["present", "absent"])
    assert many.value.key == "absent"


def test_exists_size_delete_idempotent(store: ObjectStore) -> None:
    assert not store.exists("d/x")
    store.put("d/x", b"12345")
    store.put("d/y", b"1")
    assert store.exists("d/x")
    assert store.size("d/x") == 5
    store.delete("d/x")
    assert not store.exists("d/x")
    store.delete("d/x")  # again: no error
    store.delete("never/existed")
    assert store.list() == ["d/y"]
    assert store.get("d/y") == b"1"
    # A "directory" of keys is not itself an object.
    assert not store.exists("d")
    store.delete("d")
    assert store.get("d/y") == b"1"


def test_list_by_prefix_is_sorted_and_string_based(store: ObjectStore) -> None:
    keys = ["b/5", "a/2", "a/1", "a/b/3", "ab/4", "step-1/x", "step-10/y", "z"]
    for k in keys:
        store.put(k, k.encode())
    assert store.list() == sorted(keys)
    assert store.list("a/") == ["a/1", "a/2", "a/b/3"]
    assert store.list("a") == ["a/1", "a/2", "a/b/3", "ab/4"]
    assert store.list("a/b") == ["a/b/3"]
    assert store.list("step-1") == ["step-1/x", "step-10/y"]
    assert store.list("step-1/") == ["step-1/x"]
    assert store.list("step-1/x") == ["step-1/x"]
    assert store.list("nothing") == []
    assert store.list("nothing/deeper/") == []


def test_put_if_absent_is_write_once(store: ObjectStore) -> None:
    assert store.put_if_absent("step-3/_MANIFEST.json", b'{"first": true}') is True
    assert store.put_if_absent("step-3/_MANIFEST.json", b'{"second": true}') is False
    assert store.get("step-3/_MANIFEST.json") == b'{"first": true}'
    assert store.list("step-3/") == ["step-3/_MANIFEST.json"]
    # A plain put still overwrites a marker; only put_if_absent is conditional.
    store.put("step-3/_MANIFEST.json", b"replaced")
    assert store.get("step-3/_MANIFEST.json") == b"replaced"


def test_put_if_absent_concurrent_exactly_one_wins(store: ObjectStore) -> None:
    threads_n = 8
    for round_ in range(3):
        key = f"race/{round_}/_COMMIT"
        barrier = threading.Barrier(threads_n)
        results: dict[int, bool] = {}
        errors: list[BaseException] = []

        def attempt(
            i: int, key: str, barrier: threading.Barrier, results: dict[int, bool], errors: list[BaseException]
        ) -> None:
            try:
                barrier.wait(timeout=10)
                results[i] = store.put_if_absent(key, f"writer-{i}".encode() * 100)
            except BaseException as e:  # reported below; a thread's exception is otherwise lost
                errors.append(e)

        threads = [threading.Thread(target=attempt, args=(i, key, barrier, results, errors)) for i in range(threads_n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        winners = [i for i, won in results.items() if won]
        assert len(results) == threads_n
        assert len(winners) == 1, f"round {round_}: winners {winners}"
        assert store.get(key) == f"writer-{winners[0]}".encode() * 100
    assert all(k.endswith("/_COMMIT") for k in store.list())


def test_get_range(store: ObjectStore) -> None:
    data = bytes(range(256)) * 40  # 10,240 bytes
    store.put("r", data)
    assert store.get_range("r", 0, 10) == data[:10]
    assert store.get_range("r", 1000, 300) == data[1000:1300]
    assert store.get_range("r", len(data) - 5, 100) == data[-5:]  # clipped at the end
    assert store.get_range("r", len(data), 10) == b""
    assert store.get_range("r", len(data) + 100, 1) == b""
    assert store.get_range("r", 7, 0) == b""
    store.put("r-empty", b"")
    assert store.get_range("r-empty", 0, 10) == b""
    with pytest.raises(ValueError, match="start and length"):
        store.get_range("r", -1, 10)
    with pytest.raises(ValueError, match="start and length"):
        store.get_range("r", 0, -1)


def test_put_file_get_file(store: ObjectStore, tmp_path: Path) -> None:
    data = _rand(300_000, 2)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    store.put_file("files/src.bin", src)
    assert store.get("files/src.bin") == data
    dest = tmp_path / "dl" / "nested" / "copy.bin"
    store.get_file("files/src.bin", dest)
    assert dest.read_bytes() == data
    assert sorted(p.name for p in dest.parent.iterdir()) == ["copy.bin"]  # no temp left behind
    # get_file replaces an existing file whole.
    store.put("files/small", b"tiny")
    store.get_file("files/small", dest)
    assert dest.read_bytes() == b"tiny"


def test_put_many_get_many_counts_bytes(store: ObjectStore, backend: str) -> None:
    items = {f"shards/{i:03d}.bin": _rand(1000 + 37 * i, 100 + i) for i in range(20)}
    total = sum(len(v) for v in items.values())
    put_before, get_before = BYTES.value(op="put", backend=backend), BYTES.value(op="get", backend=backend)
    n_before = SECONDS.count(op="put", backend=backend)
    store.put_many(items)
    assert store.list("shards/") == sorted(items)
    got = store.get_many(reversed(list(items)))
    assert got == items
    assert list(got) == list(reversed(list(items)))  # keys in the order asked
    assert BYTES.value(op="put", backend=backend) - put_before == total
    assert BYTES.value(op="get", backend=backend) - get_before == total
    assert SECONDS.count(op="put", backend=backend) - n_before == 20
    assert store.get_many([]) == {}


def test_put_many_rejects_a_bad_key_before_writing_anything(store: ObjectStore) -> None:
    with pytest.raises(ValueError, match="'bad//key'"):
        store.put_many({"good/1": b"1", "bad//key": b"2", "good/2": b"3"})
    assert store.list() == []


def test_multipart_sized_object_round_trips(store: ObjectStore, tmp_path: Path) -> None:
    data = _rand(12 * MiB + 123, 3)
    store.put("big/blob", data)
    assert store.size("big/blob") == len(data)
    assert store.get("big/blob") == data
    boundary = 5 * MiB
    assert store.get_range("big/blob", boundary - 10, 20) == data[boundary - 10 : boundary + 10]
    src = tmp_path / "big.bin"
    src.write_bytes(data[::-1])
    store.put_file("big/file", src)
    dest = tmp_path / "big.out"
    store.get_file("big/file", dest)
    assert dest.read_bytes() == data[::-1]


BAD_KEYS = ["", "/abs", "a/../b", "..", ".", "./a", "a//b", "a/", "a\\b", "nul\x00", TEMP_PREFIX + "x", "x" * 1025]


def test_invalid_keys_are_rejected_by_every_op(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "f"
    src.write_bytes(b"x")
    for key in BAD_KEYS:
        ops = {
            "put": lambda key=key: store.put(key, b"x"),
            "put_file": lambda key=key: store.put_file(key, src),
            "put_if_absent": lambda key=key: store.put_if_absent(key, b"x"),
            "get": lambda key=key: store.get(key),
            "get_range": lambda key=key: store.get_range(key, 0, 1),
            "get_file": lambda key=key: store.get_file(key, tmp_path / "out"),
            "exists": lambda key=key: store.exists(key),
            "size": lambda key=key: store.size(key),
            "delete": lambda key=key: store.delete(key),
            "url": lambda key=key: store.url(key),
            "get_many": lambda key=key: store.get_many([key]),
            "put_many": lambda key=key: store.put_many({key: b"x"}),
        }
        for name, op in ops.items():
            with pytest.raises(ValueError, match="invalid object key") as err:
                op()
            assert repr(key)[:40] in str(err.value), (name, key)
    assert store.list() == []


def test_invalid_list_prefixes_are_rejected(store: ObjectStore) -> None:
    for prefix in ["/a", "../x", "a/../b/", "a//", "a\\b"]:
        with pytest.raises(ValueError, match="invalid object key") as err:
            store.list(prefix)
        assert repr(prefix) in str(err.value)


def test_unusual_but_valid_keys(store: ObjectStore) -> None:
    keys = ["sp ace/ü.bin", "..dots", "a.b/.hidden", "x=1,y=2/+plus"]
    for k in keys:
        store.put(k, k.encode())
    assert store.list() == sorted(keys)
    assert all(store.get(k) == k.encode() for k in keys)


def test_readers_see_whole_objects_during_overwrites(store: ObjectStore) -> None:
    a, b = b"A" * 300_000, b"B" * 200_000
    store.put("hot", a)
    stop = threading.Event()
    seen: list[bytes] = []

    def read() -> None:
        while not stop.is_set():
            seen.append(store.get("hot"))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(30):
            store.put("hot", b if i % 2 == 0 else a)
    finally:
        stop.set()
        reader.join()
    assert seen, "the reader never ran"
    assert {len(x) for x in seen} <= {len(a), len(b)}
    assert all(x in (a, b) for x in seen)


def test_url_names_the_backend(store: ObjectStore, backend: str) -> None:
    url = store.url("w/step-1/shard-0.bin")
    if backend == "local":
        assert url.startswith("file:///") and url.endswith("/store/w/step-1/shard-0.bin")
    else:
        assert url.startswith("s3://t-") and url.endswith("/run-1/w/step-1/shard-0.bin")


# -- local backend ---------------------------------------------------------------------------


def test_local_write_goes_through_a_temp_file_and_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalObjectStore(tmp_path / "root")
    store.put("m/obj", b"old")
    real_replace = os.replace
    checked: list[str] = []

    def spy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        s, d = Path(src), Path(dst)
        assert s.parent == d.parent  # same directory: same filesystem, so the rename is atomic
        assert s.name.startswith(TEMP_PREFIX)
        assert s.read_bytes() == b"new content, complete before it is visible"
        # Mid-write, readers and listings see only the old, whole object.
        assert store.get("m/obj") == b"old"
        assert store.list() == ["m/obj"]
        checked.append(s.name)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    store.put("m/obj", b"new content, complete before it is visible")
    assert len(checked) == 1
    assert store.get("m/obj") == b"new content, complete before it is visible"
    assert sorted(os.listdir(tmp_path / "root" / "m")) == ["obj"]


def test_local_failed_write_leaves_old_object_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    store = LocalObjectStore(tmp_path / "root")
    store.put("m/obj", b"old")
    src = tmp_path / "src"
    src.write_bytes(b"y" * 10_000)

    def half_then_fail(fsrc: object, fdst: object, length: int = 0) -> None:
        fdst.write(b"y" * 5000)  # type: ignore[attr-defined]
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(shutil, "copyfileobj", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        store.put_file("m/obj", src)
    assert store.get("m/obj") == b"old"
    assert sorted(os.listdir(tmp_path / "root" / "m")) == ["obj"]


def test_local_list_skips_temp_files_and_delete_prunes_dirs(tmp_path: Path) -> None:
    root = tmp_path / "root"
    store = LocalObjectStore(root)
    store.put("p/q/r", b"1")
    (root / "p" / "q" / f"{TEMP_PREFIX}deadbeef").write_bytes(b"partial")
    assert store.list() == ["p/q/r"]
    assert store.list("p/q/") == ["p/q/r"]
    (root / "p" / "q" / f"{TEMP_PREFIX}deadbeef").unlink()
    store.delete("p/q/r")
    assert os.listdir(root) == []  # emptied folders went with the last key
    store.put("p", b"a key where a folder used to be")
    assert store.get("p") == b"a key where a folder used to be"


def test_local_fsync_mode_round_trips(tmp_path: Path) -> None:
    store = setup_store(StoreConfig(type="local", root=str(tmp_path / "s"), fsync=True))
    store.put("a/b", b"durable")
    assert store.put_if_absent("a/c", b"marker") is True
    assert store.put_if_absent("a/c", b"other") is False
    assert store.get_many(["a/b", "a/c"]) == {"a/b": b"durable", "a/c": b"marker"}


# -- S3 backend ------------------------------------------------------------------------------


@pytest.fixture
def s3_cfg(s3_server: Server, aws_env: None, tmp_path: Path) -> StoreConfig:
    return _config("s3", tmp_path, s3_server.url, bucket=f"t-{uuid.uuid4().hex[:16]}")


def test_s3_large_put_is_multipart(s3_cfg: StoreConfig) -> None:
    store = setup_store(s3_cfg)
    try:
        store.put("big", _rand(12 * MiB, 4))
        head = store._client.head_object(Bucket=store.bucket, Key="run-1/big")  # type: ignore[attr-defined]
        assert head["ETag"].strip('"').endswith("-3")  # a multipart ETag: 3 parts of 5 MiB
        store.put("small", b"x" * 1000)
        head = store._client.head_object(Bucket=store.bucket, Key="run-1/small")  # type: ignore[attr-defined]
        assert "-" not in head["ETag"]
    finally:
        store.close()


def test_s3_ranged_read_restarts_when_the_object_changes(s3_cfg: StoreConfig) -> None:
    from slipstream.store.s3 import REREAD_COUNT

    store = setup_store(s3_cfg)
    old, new = _rand(11 * MiB, 5), _rand(11 * MiB, 6)
    try:
        store.put("moving", old)
        real_get = store._client.get_object  # type: ignore[attr-defined]
        calls = {"n": 0}

        def get_then_replace(**kw: object) -> object:
            resp = real_get(**kw)
            calls["n"] += 1
            if calls["n"] == 1:  # after the first range, before the parts: replace the object
                store.put("moving", new)
            return resp

        store._client.get_object = get_then_replace  # type: ignore[attr-defined]
        before = REREAD_COUNT.value(backend="s3")
        assert store.get("moving") == new  # never a stitch of old and new
        assert REREAD_COUNT.value(backend="s3") - before == 1
    finally:
        store.close()


def test_s3_prefixes_isolate_stores_in_one_bucket(s3_cfg: StoreConfig) -> None:
    one = setup_store(s3_cfg)
    other_cfg = StoreConfig(**{**{f: getattr(s3_cfg, f) for f in s3_cfg.__struct_fields__}, "url": s3_cfg.url + "-b"})
    two = setup_store(other_cfg)
    try:
        one.put("k", b"1")
        two.put("k", b"2")
        assert one.list() == ["k"] and two.list() == ["k"]
        assert (one.get("k"), two.get("k")) == (b"1", b"2")
    finally:
        one.close()
        two.close()


def test_s3_missing_bucket_is_a_clear_error(s3_server: Server, aws_env: None) -> None:
    cfg = StoreConfig(type="s3", url="s3://no-such-bucket-here/x", endpoint_url=s3_server.url, addressing_style="path")
    with pytest.raises(BucketNotFound, match=r"'no-such-bucket-here'.*create_bucket"):
        setup_store(cfg)


# -- configuration ---------------------------------------------------------------------------


def test_parse_s3_url() -> None:
    assert parse_s3_url("s3://bucket/a/b") == parse_s3_url("s3://bucket/a/b/")
    loc = parse_s3_url("s3://my.bucket-1/weights/run-7")
    assert (loc.bucket, loc.prefix) == ("my.bucket-1", "weights/run-7/")
    assert parse_s3_url("s3://bkt").prefix == ""
    assert parse_s3_url("s3://bkt/").prefix == ""
    assert loc.url("k") == "s3://my.bucket-1/weights/run-7/k"


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://bucket/x", "must look like s3://"),
        ("s3:/bucket", "must look like s3://"),
        ("bucket/x", "must look like s3://"),
        ("s3://", "names no bucket"),
        ("s3:///x", "names no bucket"),
        ("s3://Bad_Bucket", "invalid S3 bucket name"),
        ("s3://ab", "invalid S3 bucket name"),
        ("s3://bucket/../x", "'..' segments"),
        ("s3://bucket/a//b", "empty path segment"),
    ],
)
def test_malformed_s3_urls_are_clear_errors(url: str, why: str) -> None:
    with pytest.raises(ValueError, match="store URL") as err:
        parse_s3_url(url)
    assert why in str(err.value)
    assert repr(url) in str(err.value)


def test_setup_store_rejects_bad_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"store\.url must be set"):
        setup_store(StoreConfig(type="s3"))
    with pytest.raises(ValueError, match=r"store\.max_concurrency"):
        setup_store(StoreConfig(type="local", root=str(tmp_path), max_concurrency=0))
    with pytest.raises(ValueError, match="multipart_chunksize must be >= 5242880"):
        setup_store(StoreConfig(type="s3", url="s3://bkt", multipart_chunksize=MiB))
    assert isinstance(setup_store(StoreConfig(type="local", root=str(tmp_path / "x"))), LocalObjectStore)
