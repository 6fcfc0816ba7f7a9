"""The S3 object store (boto3): AWS S3 or any S3-compatible server (MinIO, moto, Ceph).

Large objects move in parallel parts: uploads through s3transfer's multipart manager, reads as
parallel ranged GETs pinned to the first response's ETag, so an object replaced mid-read is
re-read rather than stitched from two versions. Write-once commit markers use conditional
PUT (`If-None-Match: *`). Checksums are computed only when S3 requires them, because botocore's
default (since 1.36) breaks many S3-compatible servers. Credentials come from the standard AWS
chain (environment, shared config, instance role), never from Slipstream's config.
"""

from __future__ import annotations

import builtins
import io
import logging
import os
import re
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.config import Config
from botocore.exceptions import ClientError

from slipstream.store.errors import BucketNotFound, ObjectNotFound
from slipstream.store.key import check_key, check_prefix
from slipstream.store.location import S3Location, check_bucket, normalize_prefix
from slipstream.store.protocol import Data, StrPath
from slipstream.store.transfer import BatchTransfers, byte_view, metered
from slipstream.telemetry.metrics import counter

log = logging.getLogger(__name__)

MIN_PART = 5 * 1024 * 1024  # S3 rejects multipart parts below 5 MiB (except the last)
_NOT_FOUND = frozenset({"404", "NoSuchKey", "NotFound"})
_NO_BUCKET = frozenset({"404", "NoSuchBucket", "NotFound"})
_EXISTS = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "412", "409"})
_CONTENT_RANGE = re.compile(r"^bytes \d+-\d+/(\d+)$")
_REREADS = 3  # attempts at a consistent ranged read of an object that keeps being replaced
REREAD_COUNT = counter("store/transfer/rereads", "Ranged S3 reads restarted because the object changed mid-read.")


def _code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


class _ObjectChanged(Exception):
    """A part's If-Match failed: the object was replaced after the first range was read."""


class S3ObjectStore(BatchTransfers):
    backend = "s3"

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str = "us-east-1",
        max_concurrency: int = 8,
        multipart_threshold: int = 16 * 1024 * 1024,
        multipart_chunksize: int = 16 * 1024 * 1024,
        create_bucket: bool = False,
        addressing_style: str = "auto",
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if multipart_chunksize < MIN_PART:
            raise ValueError(
                f"multipart_chunksize must be >= {MIN_PART} (S3's minimum part), got {multipart_chunksize}"
            )
        if multipart_threshold < 1:
            raise ValueError(f"multipart_threshold must be >= 1, got {multipart_threshold}")
        self.location = S3Location(check_bucket(bucket), normalize_prefix(prefix))
        self.bucket = bucket
        self.prefix = self.location.prefix
        self.endpoint = endpoint_url or f"AWS S3 ({region})"
        self.max_concurrency = max_concurrency
        self.threshold = multipart_threshold
        self.chunk = multipart_chunksize
        config = Config(
            region_name=region,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            retries={"mode": "standard"},
            # Batch threads, ranged-read part threads and the upload manager's threads may all be busy at once.
            max_pool_connections=max(10, max_concurrency * 3),
            s3={"addressing_style": addressing_style},
        )
        # A session per store: boto3's default session is not safe to create clients from concurrently.
        self._client = boto3.session.Session().client("s3", endpoint_url=endpoint_url or None, config=config)
        self._parts = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="s3-part")
        self._uploads = create_transfer_manager(
            self._client,
            TransferConfig(
                multipart_threshold=multipart_threshold,
                multipart_chunksize=multipart_chunksize,
                max_concurrency=max_concurrency,
                use_threads=True,
                preferred_transfer_client="classic",
            ),
        )
        try:
            self._ensure_bucket(create_bucket)
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"S3ObjectStore({self.location.url()!r}, endpoint={self.endpoint!r})"

    def _ensure_bucket(self, create: bool) -> None:
        try:
            self._client.head_bucket(Bucket=self.bucket)
            return
        except ClientError as e:
            if _code(e) not in _NO_BUCKET:
                raise
        if not create:
            raise BucketNotFound(self.bucket, self.endpoint)
        region = self._client.meta.region_name
        kwargs: dict[str, Any] = {}
        if region and region != "us-east-1":  # us-east-1 rejects an explicit LocationConstraint
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
        try:
            self._client.create_bucket(Bucket=self.bucket, **kwargs)
            log.info("created S3 bucket %s at %s", self.bucket, self.endpoint)
        except ClientError as e:
            if _code(e) != "BucketAlreadyOwnedByYou":  # another replica created it first: fine
                raise

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _not_found(self, key: str) -> ObjectNotFound:
        return ObjectNotFound(key, self.location.url())

    def _call(self, key: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        """One S3 request about `key`, with 'no such key' turned into ObjectNotFound."""
        try:
            return fn(Bucket=self.bucket, Key=self._key(key), **kwargs)
        except ClientError as e:
            if _code(e) in _NOT_FOUND:
                raise self._not_found(key) from None
            raise

    # -- writing -----------------------------------------------------------------------------

    def put(self, key: str, data: Data) -> None:
        s3key = self._key(key)
        view = byte_view(data)
        with metered("put", self.backend, lambda: view.nbytes):
            if view.nbytes >= self.threshold:
                self._uploads.upload(io.BytesIO(view), self.bucket, s3key).result()
            else:
                self._client.put_object(Bucket=self.bucket, Key=s3key, Body=_body(view))

    def put_file(self, key: str, path: StrPath) -> None:
        s3key = self._key(key)
        nbytes = os.path.getsize(path)
        with metered("put", self.backend, lambda: nbytes):
            # s3transfer sends files under the threshold as one PUT and larger ones as parallel parts.
            self._uploads.upload(os.fspath(path), self.bucket, s3key).result()

    def put_if_absent(self, key: str, data: Data) -> bool:
        s3key = self._key(key)
        view = byte_view(data)
        with metered("put", self.backend, lambda: view.nbytes):
            try:
                self._client.put_object(Bucket=self.bucket, Key=s3key, Body=_body(view), IfNoneMatch="*")
            except ClientError as e:
                # 412: the key exists. 409: a concurrent conditional write to the same key won the race.
                if _code(e) in _EXISTS:
                    return False
                raise
        return True

    # -- reading -----------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        out = b""
        with metered("get", self.backend, lambda: len(out)):
            out = self._read_whole(key)
        return out

    def _read_whole(self, key: str) -> bytes:
        for _ in range(_REREADS):
            # The first request asks for up to `threshold` bytes: small objects take one round trip,
            # and the Content-Range of the answer gives the size of a large one.
            try:
                resp = self._call(key, self._client.get_object, Range=f"bytes=0-{self.threshold - 1}")
            except ClientError as e:
                if _code(e) != "InvalidRange":
                    raise
                resp = self._call(key, self._client.get_object)  # an empty object has no byte 0
            head = resp["Body"].read()
            m = _CONTENT_RANGE.match(resp.get("ContentRange") or "")
            total = int(m.group(1)) if m else len(head)
            if total <= len(head):
                return head
            buf = bytearray(total)
            buf[: len(head)] = head
            starts = range(len(head), total, self.chunk)
            futures = [
                self._parts.submit(self._read_part, key, buf, s, min(s + self.chunk, total), resp["ETag"])
                for s in starts
            ]
            done, pending = wait(futures, return_when=FIRST_EXCEPTION)
            for f in pending:
                f.cancel()
            wait(pending)  # no thread may still write into buf once we return or retry
            failures = [err for f in done if (err := f.exception()) is not None]
            if not failures:
                return bytes(buf)
            fatal = [err for err in failures if not isinstance(err, _ObjectChanged)]
            if fatal:
                raise fatal[0]
            REREAD_COUNT.add(1, backend=self.backend)
            log.info("object %s changed during a ranged read; reading it again", self.url(key))
        raise RuntimeError(f"object {self.url(key)} kept changing during {_REREADS} ranged reads; giving up")

    def _read_part(self, key: str, buf: bytearray, start: int, end: int, etag: str) -> None:
        try:
            resp = self._call(key, self._client.get_object, Range=f"bytes={start}-{end - 1}", IfMatch=etag)
        except ClientError as e:
            if _code(e) in ("PreconditionFailed", "412"):
                raise _ObjectChanged(key) from None
            raise
        part = resp["Body"].read()
        if len(part) != end - start:
            raise OSError(f"short ranged read of {self.url(key)}: bytes {start}-{end - 1} gave {len(part)} bytes")
        memoryview(buf)[start:end] = part

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:
            raise ValueError(f"get_range({key!r}): start and length must be >= 0, got {start}, {length}")
        out = b""
        with metered("get", self.backend, lambda: len(out)):
            if length == 0:
                self.size(key)  # still an error for a missing key
                return out
            try:
                resp = self._call(key, self._client.get_object, Range=f"bytes={start}-{start + length - 1}")
            except ClientError as e:
                if _code(e) != "InvalidRange":
                    raise
                return out  # the range starts at or past the end of an existing object
            out = resp["Body"].read()
        return out

    def get_file(self, key: str, path: StrPath) -> None:
        s3key = self._key(key)
        dest = Path(path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with metered("get", self.backend, lambda: os.path.getsize(dest)):
            # s3transfer writes a temp file beside `dest` and renames it when complete.
            try:
                self._uploads.download(self.bucket, s3key, os.fspath(dest)).result()
            except ClientError as e:
                if _code(e) in _NOT_FOUND:
                    raise self._not_found(key) from None
                raise

    def exists(self, key: str) -> bool:
        try:
            self._call(key, self._client.head_object)
        except ObjectNotFound:
            return False
        return True

    def size(self, key: str) -> int:
        return int(self._call(key, self._client.head_object)["ContentLength"])

    def delete(self, key: str) -> None:
        self._call(key, self._client.delete_object)  # S3 deletes are idempotent already

    def list(self, prefix: str = "") -> builtins.list[str]:
        full = self.prefix + check_prefix(prefix)
        keys: builtins.list[str] = []
        for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
            keys.extend(obj["Key"][len(self.prefix) :] for obj in page.get("Contents", ()))
        return sorted(keys)

    def url(self, key: str) -> str:
        return self.location.url(check_key(key))

    def close(self) -> None:
        self._uploads.shutdown()
        self._parts.shutdown(wait=True)
        self._client.close()


def _body(view: memoryview) -> bytes:
    # botocore takes bytes or a file; reuse the caller's bytes object rather than copying it.
    obj = view.obj
    if isinstance(obj, bytes) and len(obj) == view.nbytes:
        return obj
    return view.tobytes()
