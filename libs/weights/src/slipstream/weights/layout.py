"""Where a weight version lives in the object store.

weights/<run_id>/v<version>/shard-<i>.bin
weights/<run_id>/v<version>/manifest.json     (written last, write-once: the commit marker)
"""

from __future__ import annotations


def version_prefix(run_id: str, version: int) -> str:
    return f"weights/{run_id}/v{version:08d}"


def shard_key(run_id: str, version: int, index: int) -> str:
    return f"{version_prefix(run_id, version)}/shard-{index:04d}.bin"


def manifest_key(run_id: str, version: int) -> str:
    return f"{version_prefix(run_id, version)}/manifest.json"


def version_of_manifest_key(key: str) -> int:
    """Inverse of manifest_key (for listings)."""
    part = key.rsplit("/", 2)[-2]
    if not part.startswith("v"):
        raise ValueError(f"not a manifest key: {key!r}")
    return int(part[1:])
