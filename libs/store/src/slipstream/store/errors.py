"""The store's errors: a missing object and a missing S3 bucket, each naming what is missing."""

from __future__ import annotations


class ObjectNotFound(KeyError):
    """The key names no object. A KeyError, so `except KeyError` callers keep working."""

    def __init__(self, key: str, where: str = "") -> None:
        super().__init__(key)
        self.key = key
        self.where = where

    def __str__(self) -> str:
        # KeyError's own __str__ is just repr(key); say what was looked for and where.
        place = f" in {self.where}" if self.where else ""
        return f"object not found: {self.key!r}{place}"


class BucketNotFound(LookupError):
    """The configured S3 bucket does not exist and the store may not create it."""

    def __init__(self, bucket: str, endpoint: str) -> None:
        super().__init__(bucket)
        self.bucket = bucket
        self.endpoint = endpoint

    def __str__(self) -> str:
        return (
            f"S3 bucket {self.bucket!r} does not exist at {self.endpoint}; "
            "create it, or set store.create_bucket = true to let the store create it"
        )
