"""Object-store configuration section (`[store]`)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

Doc = msgspec.Meta


class StoreConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Annotated[Literal["local", "s3"], Doc(description="Backend: 'local' (a directory) or 's3' (boto3).")] = (
        "local"
    )
    root: Annotated[str, Doc(description="Local store directory (type=local).")] = ".slipstream/store"
    url: Annotated[str, Doc(description="s3://bucket/prefix (type=s3).")] = ""
    endpoint_url: Annotated[str, Doc(description="S3 API endpoint for S3-compatible stores; empty for AWS.")] = ""
    region: Annotated[str, Doc(description="S3 region.")] = "us-east-1"
    max_concurrency: Annotated[int, Doc(description="Parallel part/shard transfers.")] = 8
    multipart_threshold: Annotated[int, Doc(description="Objects at least this large upload in parallel parts.")] = (
        16 * 1024 * 1024
    )
    multipart_chunksize: Annotated[int, Doc(description="Part size of multipart transfers.")] = 16 * 1024 * 1024
    create_bucket: Annotated[
        bool,
        Doc(description="Create the S3 bucket when it is missing (tests, local stacks); otherwise it is an error."),
    ] = False
    addressing_style: Annotated[
        Literal["auto", "path", "virtual"],
        Doc(description="S3 addressing: 'path' for most S3-compatible servers (MinIO, moto), 'auto' for AWS."),
    ] = "auto"
    fsync: Annotated[
        bool, Doc(description="fsync each local object and its directory before it becomes visible (type=local).")
    ] = False
