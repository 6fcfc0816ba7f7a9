"""Where a weight version lives in the object store.

weights/<run_id>/v<version>/shard-<i>.bin
weights/<run_id>/v<version>/manifest.json     (written last, write-once: the commit marker)

A version published per learner rank (slipstream.weights.parts) keeps each rank's part apart:

weights/<run_id>/v<version>/rank-<r>/shard-<i>.bin
weights/<run_id>/v<version>/rank-<r>/part.json    (rank r's part record, write-once)
weights/<run_id>/v<version>/abandoned.json        (write-once: the version will never be committed)
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


def part_prefix(run_id: str, version: int, rank: int) -> str:
    return f"{version_prefix(run_id, version)}/rank-{rank}"


def part_shard_key(run_id: str, version: int, rank: int, index: int) -> str:
    return f"{part_prefix(run_id, version, rank)}/shard-{index:04d}.bin"


def part_key(run_id: str, version: int, rank: int) -> str:
    return f"{part_prefix(run_id, version, rank)}/part.json"


def abandoned_key(run_id: str, version: int) -> str:
    return f"{version_prefix(run_id, version)}/abandoned.json"
