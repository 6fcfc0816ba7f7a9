"""Consumers of `weights.announce` compare its fencing token: a deposed learner's late announce is ignored.

The publisher checks the lease right before it announces, yet the lease can move in the
milliseconds between that check and the announce. Followers (rollout workers) and the eval gate
close that gap: once they have seen a token, an announce under a lower one is skipped and
counted; token 0 (staged without a control plane) carries nothing to compare. With a verifier, an
announce is checked before it can take the slot: a forged version far ahead, or a real one under
a spoofed higher token, is refused and the real versions after it still go through.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from slipstream.eval_gate.config import GateSection
from slipstream.eval_gate.gate import Gate
from slipstream.rollout_worker.follower import WeightFollower
from slipstream.rollout_worker.instruments import ANNOUNCES_SKIPPED
from slipstream.schemas import WeightAnnounce, WeightManifest, to_json
from slipstream.store import LocalObjectStore
from slipstream.trust import AnnounceVerifier, Keyring, SigningKey, sign_manifest
from slipstream.weights import manifest_key

pytestmark = pytest.mark.unit

RUN = "r"


def _announce(version: int, token: int) -> WeightAnnounce:
    return WeightAnnounce(policy_version=version, manifest_key=f"{RUN}/v{version}", run_id=RUN, fence_token=token)


def _skipped(reason: str) -> float:
    return ANNOUNCES_SKIPPED.value(reason=reason)


def test_a_follower_ignores_an_announce_under_an_older_token() -> None:
    engine = SimpleNamespace(policy_version=0)
    follower = WeightFollower(cast(Any, None), cast(Any, None), cast(Any, engine), run_id=RUN, retries=0, backoff_s=0.0)
    fenced = _skipped("fenced")

    assert follower.offer(_announce(1, 5))
    assert follower.offer(_announce(2, 7))  # the lease moved to a new holder (token 7)
    # Learner under token 5 announces a later version after token 7 was seen: it no longer leads.
    assert not follower.offer(_announce(3, 5))
    assert _skipped("fenced") == fenced + 1
    assert follower.fence_token == 7 and follower._newest is not None and follower._newest.policy_version == 2
    # The new leader's own versions, and unfenced announces, still go through.
    assert follower.offer(_announce(3, 7))
    assert follower.offer(_announce(4, 0))
    assert follower.offer(_announce(5, 8))
    assert follower.fence_token == 8


async def test_the_eval_gate_does_not_judge_a_deposed_learners_candidate() -> None:
    evaluator = SimpleNamespace(suite=SimpleNamespace(name="suite"))
    gate = Gate(
        GateSection(every_n_versions=1000),  # nothing due: an accepted announce stops at "not_due"
        run_id=RUN,
        evaluator=cast(Any, evaluator),
        store=cast(Any, None),
        evals=cast(Any, None),
        bus=cast(Any, None),
    )
    assert await gate.consider(_announce(1, 3)) == "not_due"
    assert await gate.consider(_announce(2, 4)) == "not_due"
    assert await gate.consider(_announce(3, 3)) == "fenced"
    assert await gate.consider(_announce(3, 0)) == "not_due"
    assert gate.fence_token == 4


# ---------------------------------------------------------------- forged announces never hold real ones back


async def test_a_forged_version_far_ahead_does_not_hide_the_real_ones(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "store")
    key = SigningKey.of(Ed25519PrivateKey.generate())
    verifier = AnnounceVerifier(store, run_id=RUN, keyring=Keyring.parse([key.public]))
    engine = SimpleNamespace(policy_version=0)
    follower = WeightFollower(
        cast(Any, None), store, cast(Any, engine), run_id=RUN, retries=0, backoff_s=0.0, verifier=verifier
    )

    def real(version: int, token: int = 5) -> WeightAnnounce:
        m = sign_manifest(WeightManifest(policy_version=version, run_id=RUN, fence_token=token), key)
        a = WeightAnnounce(
            policy_version=version, manifest_key=manifest_key(RUN, version), run_id=RUN, fence_token=token
        )
        store.put(a.manifest_key, to_json(m))
        return a

    assert await follower.consider(real(1))
    # Far ahead, no manifest: refused before it reaches the slot.
    assert not await follower.consider(_announce(1000, 5))
    # A real version under a token nobody signed (spoofed upwards): refused, and the high-water mark stays.
    spoofed = real(2)
    assert not await follower.consider(WeightAnnounce(**{**msgspec.structs.asdict(spoofed), "fence_token": 999}))
    assert follower.fence_token == 5
    assert await follower.consider(spoofed)
    assert await follower.consider(real(3))
    assert follower._newest is not None and follower._newest.policy_version == 3
    assert follower.announced == 3
    assert verifier.refused == {"missing_manifest": 1, "fence": 1}
    assert follower.status()["announces"]["refused"] == {"missing_manifest": 1, "fence": 1}
