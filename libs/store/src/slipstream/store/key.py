"""Object keys: '/'-separated relative paths, checked once at the store boundary.

Every backend accepts exactly the same keys, so a key that works against the local directory
in tests also works against S3 in production, and no key can escape the local store's root
('..', absolute paths) or mean two things (empty segments, backslashes).
"""

from __future__ import annotations

# Local temp files carry this name prefix; keys may not use it, so listing can skip temp files
# without ever hiding a real object.
TEMP_PREFIX = ".~partial-"

# S3's limit on a key (UTF-8 bytes), applied to every backend so local keys stay portable.
MAX_KEY_BYTES = 1024


def _bad(key: object, why: str) -> ValueError:
    return ValueError(f"invalid object key {key!r}: {why}")


def _check_segment(key: str, seg: str) -> None:
    if seg == "":
        raise _bad(key, "empty path segment (leading, trailing or doubled '/')")
    if seg in (".", ".."):
        raise _bad(key, f"'{seg}' segments are not allowed")
    if seg.startswith(TEMP_PREFIX):
        raise _bad(key, f"segments starting with {TEMP_PREFIX!r} are reserved for temp files")


def _check_chars(key: str) -> None:
    if "\\" in key:
        raise _bad(key, "backslashes are not allowed; use '/'")
    if "\x00" in key:
        raise _bad(key, "NUL characters are not allowed")
    if key.startswith("/"):
        raise _bad(key, "absolute paths are not allowed; keys are relative")
    if len(key.encode("utf-8")) > MAX_KEY_BYTES:
        raise _bad(key, f"longer than {MAX_KEY_BYTES} UTF-8 bytes")


def check_key(key: str) -> str:
    """Return `key` unchanged if it is a valid object key, else raise ValueError naming it."""
    if not isinstance(key, str):
        raise _bad(key, f"must be a str, not {type(key).__name__}")
    if key == "":
        raise _bad(key, "empty key")
    _check_chars(key)
    for seg in key.split("/"):
        _check_segment(key, seg)
    return key


def check_prefix(prefix: str) -> str:
    """Validate a list prefix: a key's leading characters (may be empty, end with '/', or stop mid-segment)."""
    if not isinstance(prefix, str):
        raise _bad(prefix, f"prefix must be a str, not {type(prefix).__name__}")
    if prefix == "":
        return prefix
    _check_chars(prefix)
    *whole, _partial = prefix.split("/")
    for seg in whole:
        _check_segment(prefix, seg)
    return prefix
