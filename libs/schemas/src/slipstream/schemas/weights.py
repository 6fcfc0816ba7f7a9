"""Weight versions: the manifest in the object store and the small messages that announce them.

Bytes never travel on the bus: the manifest lists shards in the object store (key, size,
sha256, codec); `WeightAnnounce` points at the manifest and is published only after the manifest
(written last) is stored.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec

Doc = msgspec.Meta


class ShardRef(msgspec.Struct, kw_only=True):
    """One stored shard of a weight version."""

    key: Annotated[str, Doc(description="Object-store key.")]
    size: Annotated[int, Doc(description="Stored (encoded) size in bytes.")]
    sha256: Annotated[str, Doc(description="Hex sha256 of the stored bytes.")]
    codec: Annotated[str, Doc(description="'raw', 'zstd', 'xor+zstd', 'sparse', ...")] = "raw"


class TensorEntry(msgspec.Struct, kw_only=True):
    """Where one tensor lives inside the shards and how it is encoded."""

    name: str
    dtype: Annotated[str, Doc(description="torch dtype name, e.g. 'bfloat16'.")]
    shape: list[int]
    shard: Annotated[int, Doc(description="Index into WeightManifest.shards.")]
    offset: Annotated[int, Doc(description="Byte offset inside the decoded shard.")]
    nbytes: Annotated[int, Doc(description="Byte length inside the decoded shard.")]
    encoding: Annotated[str, Doc(description="'full', 'xor' or 'sparse' (relative to base_version).")] = "full"


class PartRef(msgspec.Struct, kw_only=True):
    """One learner rank's part of a version published per rank (`WeightManifest.parts`)."""

    rank: Annotated[int, Doc(description="The learner rank whose weight-publisher stored this part.")]
    shards: Annotated[
        int, Doc(description="How many of WeightManifest.shards, in order after the earlier parts', are this part's.")
    ]
    keyframe: Annotated[bool, Doc(description="The part holds its tensors in full (needs no base).")] = True
    base_version: Annotated[
        int | None, Doc(description="Version a delta part applies onto (the manifest's base_version); None: keyframe.")
    ] = None
    key: Annotated[str, Doc(description="Object-store key of the part record its publisher wrote.")] = ""


class WeightManifest(msgspec.Struct, kw_only=True):
    """The commit record of one weight version; written last, write-once."""

    SCHEMA: ClassVar[str] = "WeightManifest"
    VERSION: ClassVar[int] = 1

    policy_version: int
    base_version: Annotated[int | None, Doc(description="Version this delta applies onto; None for keyframes.")] = None
    keyframe: bool = True
    run_id: str = ""
    dtype: str = "bfloat16"
    shards: list[ShardRef] = []
    tensors: list[TensorEntry] = []
    raw_bytes: Annotated[int, Doc(description="Size of the full snapshot in raw bytes.")] = 0
    stored_bytes: Annotated[int, Doc(description="Sum of the shard sizes.")] = 0
    step_finished_at: Annotated[float, Doc(description="Unix time the optimizer step ended.")] = 0.0
    created_at: float = 0.0
    signature: Annotated[str, Doc(description="sha256 over the shard digests, in order.")] = ""
    fence_token: Annotated[
        int,
        Doc(
            description=(
                "Fencing token of the learner lease the version was staged under (0: no control plane); "
                "signed with the rest, so an announce cannot claim another."
            )
        ),
    ] = 0
    key_id: Annotated[
        str,
        Doc(description="Id of the ed25519 key that signed this manifest (16 hex of its sha256); empty: unsigned."),
    ] = ""
    ed25519: Annotated[
        str,
        Doc(description="Base64 ed25519 signature over every other field (slipstream.trust.signing); empty: unsigned."),
    ] = ""
    parts: Annotated[
        list[PartRef],
        Doc(
            description="A version published per learner rank: each rank's part, in rank order, owning a run of "
            "`shards` (tensor shard indices stay global). Empty: one publisher stored the whole version."
        ),
    ] = []


class AbandonedVersion(msgspec.Struct, kw_only=True):
    """A version published per rank that will never be committed (a rank's part never arrived or did not fit).

    Stored write-once beside where its manifest would be, by the rank-0 weight-publisher; the other
    ranks' publishers read it to know the version's fate and encode the next one against the last
    committed version instead."""

    SCHEMA: ClassVar[str] = "AbandonedVersion"
    VERSION: ClassVar[int] = 1

    policy_version: int
    run_id: str = ""
    reason: Annotated[str, Doc(description="Why: the ranks whose part is missing, or how the parts disagree.")] = ""
    missing_ranks: list[int] = []
    abandoned_at: float = 0.0


class WeightAnnounce(msgspec.Struct, kw_only=True):
    """`weights.announce`: a version is fully stored and may be applied."""

    SCHEMA: ClassVar[str] = "WeightAnnounce"
    VERSION: ClassVar[int] = 1

    policy_version: int
    manifest_key: Annotated[str, Doc(description="Object-store key of the WeightManifest.")]
    base_version: int | None = None
    keyframe: bool = True
    run_id: str = ""
    step_finished_at: float = 0.0
    announced_at: float = 0.0
    fence_token: Annotated[
        int,
        Doc(
            description=(
                "Fencing token of the learner lease the version was staged under (0: staged without a "
                "control plane). Followers ignore an announce whose token is below one they have "
                "already seen for the run: it comes from a learner that no longer leads."
            )
        ),
    ] = 0


class WeightsPromoted(msgspec.Struct, kw_only=True):
    """`weights.promoted`: serving workers follow this version."""

    SCHEMA: ClassVar[str] = "WeightsPromoted"
    VERSION: ClassVar[int] = 1

    policy_version: int
    manifest_key: str
    previous_version: int | None = None
    reason: str = ""
    run_id: str = ""
    promoted_at: float = 0.0
