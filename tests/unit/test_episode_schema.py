"""The episode record: round trips, v1 trajectories decoding into one-sample episodes, stubs.

The golden `Episode`/`ScoredEpisode` fixtures (tests/fixtures/wire/v1) hold a three-sample
episode: a root policy sample with a tool turn, a summary branch and a frozen sub-agent.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from slipstream.schemas import (
    Episode,
    EpisodeRef,
    PolicySegment,
    Sample,
    SchemaError,
    ScoredEpisode,
    ScoredTrajectory,
    ToolEvent,
    Trajectory,
    Turn,
    decode,
    decode_message,
    encode,
    pack_floats,
    pack_ids,
    pack_mask,
    schema_header,
    stub_of,
)

pytestmark = pytest.mark.unit
FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "wire" / "v1"


def make_episode() -> Episode:
    root = Sample(
        sample_id="e/0",
        prompt_len=2,
        token_ids=pack_ids([1, 2, 3, 4, 5, 6]),
        logprobs=pack_floats([-0.5, 0.0, 0.0, -0.25]),
        loss_mask=pack_mask([1, 0, 0, 1]),
        segments=[PolicySegment(5, 4)],
        turns=[
            Turn(role="policy", start=2, end=3),
            Turn(role="tool", start=3, end=5),
            Turn(role="policy", start=5, end=6),
        ],
    )
    frozen = Sample(
        sample_id="e/1",
        agent_id="sub",
        role="subagent",
        trainable=False,
        prompt_len=1,
        token_ids=pack_ids([9, 10]),
        logprobs=pack_floats([-1.0]),
        loss_mask=pack_mask([1]),
        segments=[PolicySegment(2, 1)],
        branch_of="e/0",
        branch_pos=3,
        edit="handoff",
    )
    return Episode(
        episode_id="e",
        task_id="t",
        env="arith",
        group_id="g",
        samples=[root, frozen],
        tool_log=[ToolEvent(sample_id="e/0", call_id="c", name="calc", arguments='{"x": 1}', result="2")],
        counts={"turns": 2, "tool_calls": 1},
    )


def test_episode_round_trip_keeps_samples_and_tool_log() -> None:
    ep = make_episode()
    back = decode(encode(ep), Episode)
    assert back == ep
    assert back.samples[0].ids() == [1, 2, 3, 4, 5, 6]
    assert back.samples[0].mask() == [1, 0, 0, 1]
    assert back.samples[0].n_sampled() == 2
    assert back.samples[0].completion_len() == 4
    assert back.samples[1].branch_of == "e/0" and back.samples[1].edit == "handoff"
    assert back.tool_log[0].status == "ok"
    assert schema_header(Episode) == "Episode/1"
    assert schema_header(ScoredEpisode) == "ScoredEpisode/1"


def test_staleness_counts_only_trainable_samples() -> None:
    ep = make_episode()
    # The frozen sub-agent sampled at version 2; the trainable policy at 5.
    assert ep.oldest_version() == 5
    assert [s.sample_id for s in ep.trainable_samples()] == ["e/0"]
    assert ep.n_tokens() == 8 and ep.n_samples() == 2


def test_tool_status_is_validated() -> None:
    bad = msgspec.msgpack.encode({"sample_id": "s", "status": "kaput"})
    with pytest.raises(msgspec.ValidationError, match="status"):
        msgspec.msgpack.decode(bad, type=ToolEvent)


def test_golden_episode_fixture_decodes_with_every_part() -> None:
    ep = decode((FIXTURES / "Episode.msgpack").read_bytes(), Episode)
    assert [s.role for s in ep.samples] == ["policy", "summary", "subagent"]
    assert [s.trainable for s in ep.samples] == [True, True, False]
    assert ep.samples[0].mask() == [1, 0, 0, 1, 1]
    assert ep.samples[1].branch_of == "e-1/0" and ep.samples[1].branch_pos == 6
    assert ep.tool_log[1].status == "invalid_tool_call" and ep.tool_log[1].hidden
    assert ep.counts == {"turns": 3, "tool_calls": 2, "invalid_tool_call": 1}
    assert ep.oldest_version() == 7
    scored = decode((FIXTURES / "ScoredEpisode.msgpack").read_bytes(), ScoredEpisode)
    assert scored.reward == pytest.approx(0.75) and scored.episode == ep


def test_v1_trajectory_fixture_becomes_a_one_sample_episode() -> None:
    data = (FIXTURES / "Trajectory.msgpack").read_bytes()
    t = decode(data, Trajectory)
    ep = decode_message(data, "Trajectory/1", Episode)
    assert ep.episode_id == t.trajectory_id and ep.task_id == t.task_id and ep.env == t.env
    assert len(ep.samples) == 1
    s = ep.samples[0]
    assert s.token_ids == t.token_ids and s.logprobs == t.logprobs and s.loss_mask == t.loss_mask
    assert s.prompt_len == t.prompt_len and s.segments == t.segments and s.trainable and s.loss_weight == 1.0
    assert ep.final_text == t.completion_text and ep.group_id == t.group_id
    # A headerless v1 body (a producer outside Slipstream) is recognised too.
    assert decode_message(data, None, Episode) == ep


def test_v1_scored_trajectory_fixture_becomes_a_scored_episode() -> None:
    data = (FIXTURES / "ScoredTrajectory.msgpack").read_bytes()
    old = decode(data, ScoredTrajectory)
    new = decode_message(data, "ScoredTrajectory/1", ScoredEpisode)
    assert new.reward == pytest.approx(1.1) and new.reward == old.reward
    assert new.episode.samples[0].ids() == [51, 43, 53, 61, 56, 258]
    assert new.episode.samples[0].versions() == [7, 8]
    assert new.episode.oldest_version() == 7
    assert new.components == old.components and new.correct == old.correct


def test_upgrade_still_rejects_unknown_types_and_versions() -> None:
    data = encode(Trajectory(trajectory_id="a", task_id="b", env="c"))
    with pytest.raises(SchemaError, match="unknown schema version"):
        decode_message(data, "Trajectory/2", Episode)
    with pytest.raises(SchemaError, match="unexpected schema"):
        decode_message(data, "Task/1", Episode)
    with pytest.raises(SchemaError, match="unexpected schema"):  # no upgrade the other way
        decode_message(encode(make_episode()), "Episode/1", Trajectory)


def test_stub_keeps_header_fields_and_answers_from_its_ref() -> None:
    ep = make_episode()
    body = encode(ep)
    ref = EpisodeRef(key="episodes/e", size=len(body), sha256="ab", n_samples=2, n_tokens=8, oldest_version=5)
    stub = stub_of(ep, ref)
    assert stub.samples == [] and stub.tool_log == [] and stub.is_stub()
    assert (stub.episode_id, stub.task_id, stub.group_id, stub.counts) == ("e", "t", "g", ep.counts)
    assert stub.oldest_version() == 5 and stub.n_samples() == 2 and stub.n_tokens() == 8
    assert decode(encode(stub), Episode) == stub
    assert len(encode(stub)) < len(body)
