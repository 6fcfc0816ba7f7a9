"""Provenance of scores on a real, secured nats-server: credentials are not enough to be trained on.

The server runs with one user per service (`slipstream.bus.permissions`). The admin may publish
anywhere, so bus permissions cannot stop a forgery published with the admin's credentials: the
learner's signature check must. Groups published as the admin — unsigned, signed by a foreign
key, or signed by the reward-model's key and then edited — are refused, acked and counted
(`untrusted`), never trained and never counted in a group; the reward-model's signed group, the
only one, is what the single step trains. And the reward-model, given its key, signs what it
scores so that exactly this check passes, and the local stack (`slipstream up`, the demo) hands
the reward-model a signing key of its own and the learner its public half.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from scored_trajectories import eventually, group, read_steps, trajectory
from test_learner import learner_settings, scored_backlog
from test_reward_model import config, read_scored, running, traj

from slipstream.bus import BusConfig, connect_bus
from slipstream.bus.permissions import ADMIN, all_permissions, new_passwords, server_authorization
from slipstream.learner.config import LearnerConfig
from slipstream.learner.outcomes import read_outcomes
from slipstream.learner.service import LearnerService
from slipstream.reward_model.service import RewardModelService
from slipstream.runtime.config import resolve
from slipstream.schemas import ScoredEpisode, scored_episode_from_v1
from slipstream.schemas.subjects import traj_scored_subject
from slipstream.stack import Server, start_nats
from slipstream.stack.local import Stack
from slipstream.stack.spec import StackSpec
from slipstream.stack.status import read_json
from slipstream.trust import (
    Check,
    Keyring,
    SigningKey,
    check_scored,
    generate_keypair,
    load_signing_key,
    sign_scored,
)

pytestmark = pytest.mark.integration
SUBJECT = traj_scored_subject("arith")


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[Server, dict[str, str]]]:
    passwords = new_passwords(p.user for p in all_permissions())
    srv = start_nats(tmp_path / "nats", tmp_path / "logs", authorization=server_authorization(passwords))
    try:
        yield srv, passwords
    finally:
        srv.stop()


def episodes(name: str) -> list[ScoredEpisode]:
    return [scored_episode_from_v1(s) for s in group(name)]


async def test_groups_published_as_admin_without_the_reward_models_signature_are_refused_never_trained(
    secured: tuple[Server, dict[str, str]], tmp_path: Path
) -> None:
    server, passwords = secured
    reward_key, foreign = SigningKey.of(Ed25519PrivateKey.generate()), SigningKey.of(Ed25519PrivateKey.generate())

    def cfg(user: str) -> BusConfig:
        return BusConfig(url=server.url, user=user, password=passwords[user])

    admin = await connect_bus(cfg(ADMIN), name="admin")
    await admin.ensure_streams()
    reward = await connect_bus(cfg("reward-model"), name="reward-model")
    overrides = learner_settings(tmp_path, max_steps=1, groups_per_step=1, group_timeout_s=30.0, commit_when_idle_s=0)
    overrides["bus"] = {"url": server.url, "user": "learner", "password": passwords["learner"]}
    overrides["provenance"] = {"trusted_keys": [reward_key.public]}
    svc = LearnerService(resolve(LearnerConfig, environ={}, overrides=overrides))
    await svc.setup()
    stop = asyncio.Event()
    run = asyncio.create_task(svc.run(stop))
    tampered = [
        msgspec.structs.replace(s, reward=1.0 - s.reward) for s in (sign_scored(e, reward_key) for e in episodes("t"))
    ]
    # The forged groups share the genuine group's id with other members: counted, they would fill it.
    collide = [trajectory(f"c-{i}", "g/s1", size=4, reward=float(i % 2)) for i in range(4)]
    forged = {
        "unsigned": episodes("u"),
        "unknown_key": [sign_scored(e, foreign) for e in episodes("f")],
        "bad_signature": tampered,
        "collide": [scored_episode_from_v1(s) for s in collide],
    }
    try:
        for items in forged.values():
            for s in items:
                await admin.publish(SUBJECT, s, msg_id=s.episode.episode_id)  # the admin may publish here
        genuine = [sign_scored(e, reward_key) for e in episodes("g")]
        for s in genuine[:2]:
            await reward.publish(SUBJECT, s, msg_id=s.episode.episode_id)
        n_forged = sum(len(v) for v in forged.values())
        await eventually(lambda: svc.intake is not None and svc.intake.received >= n_forged + 2, 20, "the arrivals")
        assert svc.step == 0, "a step trained before the genuine group was complete"
        for s in genuine[2:]:
            await reward.publish(SUBJECT, s, msg_id=s.episode.episode_id)
        await asyncio.wait_for(run, 60)  # max_steps=1: returns after the one step
        steps = await read_steps(admin, 1, 10)
        backlog = await scored_backlog(admin)
    finally:
        stop.set()
        if not run.done():
            await asyncio.wait_for(run, 30)
        await svc.close()
        await reward.close()
        await admin.close()

    assert [(s.step, s.n_groups, s.n_trajectories) for s in steps] == [(1, 1, 4)]
    assert svc.intake is not None and svc.intake.dropped == {"untrusted": n_forged}
    assert svc.provenance is not None
    assert svc.provenance.status()["refused"] == {"unsigned": 8, "unknown_key": 4, "bad_signature": 4}
    assert svc.provenance.status()["verified"] == 4
    outcomes = read_outcomes(tmp_path / "outcomes.jsonl")
    trained = sorted(o.trajectory_id for o in outcomes if o.outcome == "trained")
    assert trained == sorted(s.episode.episode_id for s in genuine)
    dropped = {o.trajectory_id: o.reason for o in outcomes if o.outcome == "dropped"}
    assert dropped == {s.episode.episode_id: "untrusted" for v in forged.values() for s in v}
    assert backlog == (0, 0, 0)  # every forgery acked: never redelivered, never trained


async def test_the_reward_model_signs_every_scored_episode_with_its_key(nats_server: Server, tmp_path: Path) -> None:
    key = generate_keypair(tmp_path / "keys" / "scores.pem")
    cfg = config(nats_server.url, tmp_path, "rm-signed")
    cfg.provenance.signing_key = str(tmp_path / "keys" / "scores.pem")
    bus = await connect_bus(BusConfig(url=nats_server.url), name="test")
    await bus.ensure_streams()
    try:
        async with running(RewardModelService(cfg)) as svc:
            for t in (traj("right", "8"), traj("wrong", "9")):
                await bus.publish("traj.raw.arith", t, msg_id=t.trajectory_id)
            scored = await read_scored(bus, 2)
            assert svc.status()["signing_key"] == key.key_id
    finally:
        await bus.close()
    ours, other = Keyring.parse([key.public]), Keyring.parse([SigningKey.of(Ed25519PrivateKey.generate()).public])
    assert sorted(s.episode.episode_id for s in scored) == ["right", "wrong"]
    assert [check_scored(s, ours) for s in scored] == [Check.OK, Check.OK]
    assert [check_scored(s, other) for s in scored] == [Check.UNKNOWN_KEY] * 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_stack_gives_the_reward_model_a_score_key_and_the_learner_its_public_half(tmp_path: Path) -> None:
    spec = StackSpec(run_dir=tmp_path / "run", services=("reward-model", "learner"), home=tmp_path / "home")
    with Stack(spec) as stack:
        stack.wait_ready(200)
        _, learner = read_json(stack.services["learner"].port, "/readyz", 5.0)
        _, reward = read_json(stack.services["reward-model"].port, "/readyz", 5.0)
        trust = stack.info()["trust"]
    score_key = load_signing_key(trust["score_signing_key"])
    assert Path(trust["score_signing_key"]) == tmp_path / "run" / "data" / "keys" / "scores-signing.pem"
    assert trust["score_trusted_keys"] == [score_key.public]
    assert score_key.key_id != stack.signing_key_id  # not the weights key: one role, one key
    assert (reward or {})["status"]["signing_key"] == score_key.key_id
    provenance = (learner or {})["status"]["provenance"]
    assert provenance["signatures"] == "required" and provenance["trusted_keys"] == [score_key.key_id]
