"""Episodes by reference: offload over the limit, load and verify, scored stubs keep their body."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec
import pytest

from slipstream.schemas import Episode, PolicySegment, Sample, ScoredEpisode, encode, pack_floats, pack_ids, pack_mask
from slipstream.store import LocalObjectStore, ObjectNotFound
from slipstream.store.episodes import HEADROOM, EpisodeBodyError, episode_key, load, load_scored, offload

pytestmark = pytest.mark.unit


def episode(eid: str = "g/0", n: int = 1000) -> Episode:
    policy = Sample(
        sample_id=f"{eid}/p",
        prompt_len=1,
        token_ids=pack_ids(range(n + 1)),
        logprobs=pack_floats([-0.5] * n),
        loss_mask=pack_mask([1] * n),
        segments=[PolicySegment(4, n)],
    )
    frozen = msgspec.structs.replace(
        policy, sample_id=f"{eid}/f", trainable=False, segments=[PolicySegment(1, n)], agent_id="sub"
    )
    return Episode(episode_id=eid, task_id="t", env="x", run_id="run-1", samples=[policy, frozen])


def test_small_episodes_stay_inline(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    ep = episode(n=10)
    assert offload(store, ep, limit=1 << 20) is ep
    assert store.list() == []
    assert load(store, ep) is ep


def test_big_episode_goes_by_reference_and_loads_back_exactly(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    ep = episode(n=1000)  # ~14 KB: over a limit of HEADROOM + 4 KiB
    body = encode(ep)
    stub = offload(store, ep, limit=HEADROOM + 4096)
    assert stub.is_stub() and stub.samples == [] and stub.episode_id == ep.episode_id
    ref = stub.body_ref
    assert ref is not None and ref.key == episode_key("run-1", "g/0") == "run-1/episodes/g/0.msgpack"
    assert (ref.size, ref.n_samples, ref.n_tokens) == (len(body), 2, 2002)
    assert ref.oldest_version == 4  # over trainable samples: the frozen one at version 1 does not count
    assert store.get(ref.key) == body
    assert len(encode(stub)) < 1024
    assert load(store, stub) == ep
    scored = ScoredEpisode(episode=stub, reward=1.0)
    assert load_scored(store, scored).episode == ep and load_scored(store, scored).reward == 1.0
    assert offload(store, stub, limit=0) is stub  # a stub is never offloaded again


def test_a_body_that_is_not_what_the_stub_promised_is_refused(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    stub = offload(store, episode(), limit=HEADROOM + 4096)
    assert stub.body_ref is not None
    key = stub.body_ref.key
    original = store.get(key)
    store.put(key, original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.raises(EpisodeBodyError, match="sha256"):
        load(store, stub)
    store.put(key, original + b"x")
    with pytest.raises(EpisodeBodyError, match="bytes, its stub says"):
        load(store, stub)
    other = encode(episode("g/1"))
    forged = msgspec.structs.replace(
        stub, body_ref=msgspec.structs.replace(stub.body_ref, size=len(other), sha256=hashlib.sha256(other).hexdigest())
    )
    store.put(key, other)
    with pytest.raises(EpisodeBodyError, match="holds episode 'g/1'"):
        load(store, forged)
    store.delete(key)
    with pytest.raises(ObjectNotFound):
        load(store, stub)
