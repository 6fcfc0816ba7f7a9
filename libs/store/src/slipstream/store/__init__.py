"""Slipstream's object store: large bytes (weight shards, big observations) under string keys.

NATS moves messages, the object store holds bytes: a message carries a key, never the payload.
`setup_store(StoreConfig)` picks the backend (`local` directory or `s3`); every backend passes
the same contract suite (tests/contract/test_store.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from slipstream.store.config import StoreConfig
from slipstream.store.errors import BucketNotFound, ObjectNotFound
from slipstream.store.factory import setup_store
from slipstream.store.key import check_key, check_prefix
from slipstream.store.local import LocalObjectStore
from slipstream.store.location import S3Location, parse_s3_url
from slipstream.store.protocol import ObjectStore

if TYPE_CHECKING:
    from slipstream.store.s3 import S3ObjectStore

__all__ = [
    "BucketNotFound",
    "LocalObjectStore",
    "ObjectNotFound",
    "ObjectStore",
    "S3Location",
    "S3ObjectStore",
    "StoreConfig",
    "check_key",
    "check_prefix",
    "parse_s3_url",
    "setup_store",
]


def __getattr__(name: str) -> Any:
    # S3ObjectStore imports boto3 (~0.3 s); load it on first use so config parsing stays instant.
    if name == "S3ObjectStore":
        from slipstream.store.s3 import S3ObjectStore

        return S3ObjectStore
    raise AttributeError(f"module 'slipstream.store' has no attribute {name!r}")
