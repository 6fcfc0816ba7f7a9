"""Configuration of the weight-publisher service: one typed class on `ServiceConfig`.

`slipstream.runtime.base.ServiceConfig` holds the shared sections ([service], [bus], [store],
[telemetry]), each owned by its lib; this module adds the service's own.

Resolved by `slipstream.runtime.config` from defaults, a TOML file (`--config`),
`SLIPSTREAM_<SECTION>__<FIELD>` variables and `--section.field` flags, in that order.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from slipstream.runtime.base import ServiceConfig
from slipstream.trust.config import TrustConfig

Doc = msgspec.Meta


class PublisherSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`[publisher]`: where the learner stages new weights, and how they are cut and cleaned up."""

    staging_dir: Annotated[
        str,
        Doc(
            description="Directory the learner stages v<version>.safetensors into (same as [learner] staging_dir); "
            "with ranks > 1 this publisher watches its rank's <staging_dir>/rank-<rank>."
        ),
    ] = ".slipstream/staging"
    poll_interval_s: Annotated[
        float, Doc(description="Pause between two scans of the staging directory when it is empty.", gt=0)
    ] = 0.05
    shard_bytes: Annotated[
        int, Doc(description="Largest shard in bytes (a tensor never splits); shards upload in parallel.", ge=1)
    ] = 64 * 1024 * 1024
    codec: Annotated[
        Literal["delta", "snapshot"],
        Doc(description="'delta': XOR/sparse + zstd against the previous version, keyframe every K; 'snapshot': full."),
    ] = "delta"
    keyframe_every: Annotated[
        int, Doc(description="A full (compressed) snapshot every this many versions, so new workers join fast.", ge=1)
    ] = 10
    zstd_level: Annotated[int, Doc(description="zstd level of shard frames (1 is the measured sweet spot).", ge=1)] = 1
    codec_threads: Annotated[int, Doc(description="Threads encoding zstd frames; 0 = one per CPU core.", ge=0)] = 0
    delete_staged: Annotated[
        bool, Doc(description="Remove a staged file once its version is announced (false keeps them, for debugging).")
    ] = True
    retry_max_s: Annotated[
        float, Doc(description="Longest pause between retries of a version whose store or announce failed.", gt=0)
    ] = 5.0
    fence_min_remaining_s: Annotated[
        float,
        Doc(
            description="With [service] redis_url: announce a fenced version only while its learner's lease has more "
            "than this many seconds left (else wait for the renewal).",
            ge=0,
        ),
    ] = 0.5
    control_timeout_s: Annotated[
        float, Doc(description="Bound on each Redis operation of the fence check ([service] redis_url).", gt=0)
    ] = 2.0
    ranks: Annotated[
        int,
        Doc(
            description="The learner's rank count ([learner] ranks). 1 = this publisher stores whole versions; "
            "N > 1 = one publisher per rank, each storing its rank's part from <staging_dir>/rank-<rank>.",
            ge=1,
        ),
    ] = 1
    rank: Annotated[
        int, Doc(description="With ranks > 1: the learner rank whose part this publisher stores (0 commits).", ge=0)
    ] = 0
    part_timeout_s: Annotated[
        float,
        Doc(
            description="With ranks > 1, rank 0: how long after storing its own part to wait for the other ranks' "
            "parts before abandoning the version (never announced).",
            gt=0,
        ),
    ] = 60.0

    def __post_init__(self) -> None:
        if self.rank >= self.ranks:
            raise ValueError(f"rank must be below ranks ({self.ranks}), got {self.rank}")
        if self.ranks > 1 and self.codec != "delta":
            raise ValueError(f"ranks > 1 publishes parts with the delta codec; codec {self.codec!r} is not supported")


class WeightPublisherConfig(ServiceConfig, kw_only=True, forbid_unknown_fields=True):
    publisher: Annotated[PublisherSection, Doc(description="Staging directory, shard size, clean-up.")] = msgspec.field(
        default_factory=PublisherSection
    )
    trust: Annotated[TrustConfig, Doc(description="The ed25519 key each manifest is signed with.")] = msgspec.field(
        default_factory=TrustConfig
    )
