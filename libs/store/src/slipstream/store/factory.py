"""`setup_store(cfg)`: the one place that turns a `[store]` config section into a backend."""

from __future__ import annotations

from slipstream.store.config import StoreConfig
from slipstream.store.local import LocalObjectStore
from slipstream.store.location import parse_s3_url
from slipstream.store.protocol import ObjectStore


def setup_store(cfg: StoreConfig) -> ObjectStore:
    """Build the configured backend. Bad settings raise ValueError naming the `store.` field."""
    if cfg.max_concurrency < 1:
        raise ValueError(f"store.max_concurrency must be >= 1, got {cfg.max_concurrency}")
    if cfg.type == "local":
        if not cfg.root:
            raise ValueError("store.root must name a directory when store.type = 'local'")
        return LocalObjectStore(cfg.root, fsync=cfg.fsync, max_concurrency=cfg.max_concurrency)
    if cfg.type == "s3":
        if not cfg.url:
            raise ValueError("store.url must be set (s3://bucket[/prefix]) when store.type = 's3'")
        where = parse_s3_url(cfg.url)
        from slipstream.store.s3 import S3ObjectStore  # boto3 is slow to import; only S3 users pay for it

        return S3ObjectStore(
            where.bucket,
            where.prefix,
            endpoint_url=cfg.endpoint_url or None,
            region=cfg.region,
            max_concurrency=cfg.max_concurrency,
            multipart_threshold=cfg.multipart_threshold,
            multipart_chunksize=cfg.multipart_chunksize,
            create_bucket=cfg.create_bucket,
            addressing_style=cfg.addressing_style,
        )
    raise ValueError(f"store.type must be 'local' or 's3', got {cfg.type!r}")
