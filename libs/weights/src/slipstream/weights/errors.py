"""The weights package's errors: `WeightsError` and the failures every part of it can raise.

Its own module so that the codec, the chain and the per-rank parts can all raise them without
importing one another. Errors of one format stay with it (`container.ShardFormatError`,
`decoder.BaseMismatch`, `parts.PartsError`), all subclasses of `WeightsError`.
"""

from __future__ import annotations


class WeightsError(RuntimeError):
    """A weight version that cannot be published or applied."""


class CorruptShard(WeightsError):
    def __init__(self, key: str, expected: str, actual: str) -> None:
        super().__init__(f"shard {key} failed verification: sha256 {actual[:12]}… != manifest {expected[:12]}…")
        self.key = key


class VersionExists(WeightsError):
    pass
