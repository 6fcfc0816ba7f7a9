"""Where an S3 store lives: `s3://bucket/prefix` parsed into a bucket and a key prefix.

Kept apart from the S3 backend so config checks (and the factory) do not import boto3.
"""

from __future__ import annotations

import re

import msgspec

from slipstream.store.key import check_key

# S3 bucket naming rules (3-63 chars; lowercase letters, digits, dots, hyphens; alphanumeric ends).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class S3Location(msgspec.Struct, frozen=True):
    bucket: str
    prefix: str = ""  # "" or ends with "/": prepended to every key

    def url(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{self.prefix}{key}"


def check_bucket(bucket: str) -> str:
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise ValueError(
            f"invalid S3 bucket name {bucket!r}: 3-63 characters of lowercase letters, digits, '.' and '-', "
            "starting and ending with a letter or digit"
        )
    return bucket


def normalize_prefix(prefix: str) -> str:
    """'' stays ''; 'a/b' and 'a/b/' both become 'a/b/'. Segments follow the key rules."""
    stripped = prefix.rstrip("/")
    if not stripped:
        if prefix:
            raise ValueError(f"invalid S3 key prefix {prefix!r}: only slashes")
        return ""
    try:
        check_key(stripped)
    except ValueError as e:
        raise ValueError(f"invalid S3 key prefix {prefix!r}: {e}") from None
    return stripped + "/"


def parse_s3_url(url: str) -> S3Location:
    """Parse `s3://bucket[/prefix]`; a malformed URL raises ValueError saying what is wrong with it."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme != "s3":
        raise ValueError(f"store URL {url!r} must look like s3://bucket[/prefix]")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"store URL {url!r} names no bucket; expected s3://bucket[/prefix]")
    try:
        return S3Location(check_bucket(bucket), normalize_prefix(prefix))
    except ValueError as e:
        raise ValueError(f"store URL {url!r}: {e}") from None
