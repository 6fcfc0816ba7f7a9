"""Offline checks of deploy/'s multi-host settings: signed scores, a replicated bus, Sentinel-ready Redis URLs.

Rendered with the real kustomize (deploy_helpers.render) and resolved the way each service resolves
its own config at start (deploy/tools/pod_config.py):

- only the reward-model mounts the score-signing Secret, at the path its `[provenance]
  signing_key` names; in dev the learner trusts exactly the public half of that key (a pair, not
  two unrelated keys), and neither is the weights key; prod's learner has the placeholder to replace;
- prod streams are replicated (within the NATS chart's cluster size, test_deploy_manifests) and
  every client pings often enough to notice a cut link;
- a `redis+sentinel://` URL in `slipstream-credentials` is one every Redis user accepts.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from deploy_helpers import DEPLOY, pod_specs, podcfg, render

from slipstream.control import ControlClient
from slipstream.control.acl import with_user
from slipstream.trust import Keyring, load_signing_key

SECRET = "slipstream-scores-signing"


def _pods(overlay: str) -> list[Any]:
    extra = render("prod/common") if overlay.startswith("prod/") else []
    return podcfg.resolve(render(overlay) + extra)


def _mounts_of_secret(objs: list[dict[str, Any]], secret: str) -> list[tuple[str, str, str]]:
    """(owner, container, mount path) of every container mounting `secret` (dev's generator adds a hash suffix)."""
    out = []
    for owner, spec in pod_specs(objs):
        names = {v["name"]: v.get("secret", {}).get("secretName", "") for v in spec.get("volumes", [])}
        volumes = {v for v, s in names.items() if s == secret or s.startswith(f"{secret}-")}
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            out += [(owner, c["name"], m["mountPath"]) for m in c.get("volumeMounts", []) if m["name"] in volumes]
    return out


@pytest.mark.parametrize("overlay", ["dev", "prod/reward-model"])
def test_only_the_reward_model_mounts_the_score_key_where_its_config_looks(overlay: str) -> None:
    objs = render(overlay)
    mounts = _mounts_of_secret(objs, SECRET)
    assert [(owner, c) for owner, c, _ in mounts] == [("Deployment/reward-model", "reward-model")]
    (reward,) = [p for p in _pods(overlay) if p.service == "reward-model"]
    key_path = Path(reward.get("provenance", "signing_key"))
    assert str(key_path.parent) == mounts[0][2]
    # One role, one key: the reward-model does not mount the weights key.
    assert all(c != "reward-model" for _, c, _ in _mounts_of_secret(objs, "slipstream-weights-signing"))


def test_dev_learner_trusts_exactly_the_public_half_of_the_reward_models_key() -> None:
    objs = render("dev")
    (secret,) = [o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"].startswith(SECRET)]
    pem = base64.b64decode(secret["data"]["signing-key.pem"])
    pods = {p.service: p for p in _pods("dev")}
    trusted = pods["learner"].get("provenance", "trusted_keys")
    key = load_signing_key(DEPLOY / "k8s" / "overlays" / "dev" / "scores-signing.pem")
    assert pem == (DEPLOY / "k8s" / "overlays" / "dev" / "scores-signing.pem").read_bytes()
    assert trusted == [key.public] and Keyring.parse(trusted).ids == [key.key_id]
    assert key.public not in pods["rollout-worker"].get("trust", "trusted_keys")  # one role, one key


def test_prod_learner_must_be_given_the_reward_models_public_key() -> None:
    (learner,) = [p for p in _pods("prod/learner") if p.service == "learner"]
    assert learner.get("provenance", "trusted_keys") == [
        "ed25519:REPLACE_WITH_THE_PUBLIC_KEY_OF_slipstream-scores-signing"
    ]


def test_prod_streams_are_replicated_and_clients_notice_a_cut_link() -> None:
    for p in _pods("prod/reward-model") + _pods("prod/learner"):
        assert p.get("bus", "stream_replicas") == 3, p.owner
        # A link cut without a reset is noticed after ping_interval_s x max_outstanding_pings.
        assert p.get("bus", "ping_interval_s") * p.get("bus", "max_outstanding_pings") <= 30, p.owner


async def test_a_sentinel_url_with_a_services_acl_user_is_accepted_without_connecting() -> None:
    url = with_user("redis+sentinel://s1:26379,s2:26379,s3:26379/slipstream/0", "learner", "pw")
    client = ControlClient(url, timeout_s=1.0)
    try:
        assert client.min_replicas == 1
        assert client.url == "redis+sentinel://learner:***@s1:26379,s2:26379,s3:26379/slipstream/0"
    finally:
        await client.close()
