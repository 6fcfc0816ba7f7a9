"""Signed scores (slipstream.trust.scores): what the reward-model signs is what the learner checks.

The learner sees a scored episode after the bus encoded and decoded it, so every check here goes
through the wire codec. Rotation is the keyring's: both keys accepted while both are listed, the
dropped one refused after.
"""

from __future__ import annotations

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from slipstream.schemas import (
    EpisodeRef,
    PolicySegment,
    ScoredEpisode,
    ScoredTrajectory,
    Trajectory,
    WeightManifest,
    decode,
    encode,
    pack_floats,
    pack_ids,
    pack_mask,
    scored_episode_from_v1,
    stub_of,
)
from slipstream.trust import Check, Keyring, ScoreVerifier, SigningKey, check_scored, sign_manifest, sign_scored


def key() -> SigningKey:
    return SigningKey.of(Ed25519PrivateKey.generate())


def scored(tid: str = "e1", reward: float = 1.0) -> ScoredEpisode:
    traj = Trajectory(
        trajectory_id=tid,
        task_id="t1",
        env="arith",
        group_id="t1/s1",
        group_size=2,
        prompt_len=2,
        token_ids=pack_ids([1, 49, 50, 2]),
        logprobs=pack_floats([-0.5, -0.25]),
        loss_mask=pack_mask([1, 1]),
        segments=[PolicySegment(0, 2)],
    )
    return scored_episode_from_v1(
        ScoredTrajectory(trajectory=traj, reward=reward, correct=reward > 0.5, components={"b": 0.5, "a": 0.5})
    )


def wire(s: ScoredEpisode) -> ScoredEpisode:
    """What the learner decodes from what the reward-model published."""
    return decode(encode(s), ScoredEpisode)


def test_a_signed_score_checks_after_the_wire_and_an_unsigned_one_does_not() -> None:
    k = key()
    ring = Keyring.parse([k.public])
    signed = sign_scored(scored(), k)
    assert signed.key_id == k.key_id and signed.ed25519
    assert check_scored(wire(signed), ring) is Check.OK
    assert check_scored(wire(scored()), ring) is Check.UNSIGNED


def test_any_edit_of_a_signed_score_breaks_its_signature() -> None:
    k = key()
    ring = Keyring.parse([k.public])
    signed = sign_scored(scored(reward=0.0), k)
    edits = [
        msgspec.structs.replace(signed, reward=1.0),
        msgspec.structs.replace(signed, correct=True),
        msgspec.structs.replace(signed, components={"a": 0.5, "b": 0.6}),
        msgspec.structs.replace(signed, episode=msgspec.structs.replace(signed.episode, group_id="other/s1")),
        msgspec.structs.replace(signed, ed25519="not base64!"),
    ]
    assert [check_scored(wire(e), ring) for e in edits] == [Check.BAD_SIGNATURE] * len(edits)


def test_a_foreign_key_is_unknown_and_a_manifest_signature_is_no_score_signature() -> None:
    ours, theirs = key(), key()
    ring = Keyring.parse([ours.public])
    assert check_scored(wire(sign_scored(scored(), theirs)), ring) is Check.UNKNOWN_KEY
    # The same key's signature over a weight manifest, pasted onto a score: the domains differ.
    manifest = sign_manifest(WeightManifest(run_id="r", policy_version=1), ours)
    pasted = msgspec.structs.replace(scored(), key_id=manifest.key_id, ed25519=manifest.ed25519)
    assert check_scored(wire(pasted), ring) is Check.BAD_SIGNATURE


def test_a_by_reference_stub_is_signed_as_published() -> None:
    k = key()
    s = scored()
    ref = EpisodeRef(key="run/episodes/e1.msgpack", size=123, sha256="ab" * 32, n_samples=1, n_tokens=4)
    stubbed = msgspec.structs.replace(s, episode=stub_of(s.episode, ref))
    signed = sign_scored(stubbed, k)
    ring = Keyring.parse([k.public])
    assert check_scored(wire(signed), ring) is Check.OK
    other = msgspec.structs.replace(ref, sha256="cd" * 32)  # another body behind the same stub
    swapped = msgspec.structs.replace(signed, episode=stub_of(s.episode, other))
    assert check_scored(wire(swapped), ring) is Check.BAD_SIGNATURE


def test_rotation_accepts_both_keys_while_both_are_listed_then_only_the_new_one() -> None:
    old, new = key(), key()
    by_old, by_new = wire(sign_scored(scored("a"), old)), wire(sign_scored(scored("b"), new))
    during = ScoreVerifier(Keyring.parse([old.public, new.public]))
    assert during.refusal(by_old) is None and during.refusal(by_new) is None
    after = ScoreVerifier(Keyring.parse([new.public]))
    assert after.refusal(by_new) is None
    refused = after.refusal(by_old)
    assert refused is not None and refused[0] == "unknown_key" and old.key_id in refused[1]
    assert after.status()["refused"] == {"unknown_key": 1} and after.status()["verified"] == 1


def test_without_trusted_keys_nothing_is_checked_or_counted() -> None:
    v = ScoreVerifier(Keyring.parse([]))
    assert v.refusal(scored()) is None
    assert v.status() == {"signatures": "off", "trusted_keys": [], "verified": 0, "refused": {}}
