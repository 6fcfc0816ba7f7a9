"""Wire contract: round trips, packed arrays, schema headers, the subject table."""

from __future__ import annotations

import pytest

from slipstream.schemas import (
    MESSAGE_TYPES,
    UPGRADES,
    PolicySegment,
    SchemaError,
    ScoredTrajectory,
    Task,
    Trajectory,
    decode,
    decode_message,
    encode,
    pack_floats,
    pack_ids,
    pack_mask,
    schema_header,
    subjects,
)

pytestmark = pytest.mark.unit


def make_traj(n: int = 8) -> Trajectory:
    return Trajectory(
        trajectory_id="t-1",
        task_id="task-1",
        env="arith",
        prompt_len=3,
        token_ids=pack_ids(range(n)),
        logprobs=pack_floats([-0.5] * (n - 3)),
        loss_mask=pack_mask([1] * (n - 3)),
        segments=[PolicySegment(4, 2), PolicySegment(5, n - 5)],
    )


def test_trajectory_round_trip_keeps_packed_arrays() -> None:
    t = make_traj()
    back = decode(encode(t), Trajectory)
    assert back == t
    assert back.ids() == list(range(8))
    assert back.behaviour_logprobs() == [-0.5] * 5
    assert back.mask() == [1] * 5
    assert back.completion_len() == 5
    assert back.versions() == [4, 5]
    assert back.oldest_version() == 4


def test_scored_trajectory_nests() -> None:
    s = ScoredTrajectory(trajectory=make_traj(), reward=1.0, components={"correct": 1.0}, correct=True)
    assert decode(encode(s), ScoredTrajectory).components == {"correct": 1.0}


def test_header_checks_name_and_version() -> None:
    data = encode(Task(task_id="a", env="arith", prompt="1+1="))
    assert decode_message(data, "Task/1", Task).task_id == "a"
    assert decode_message(data, None, Task).prompt == "1+1="
    with pytest.raises(SchemaError, match="unknown schema version"):
        decode_message(data, "Task/2", Task)
    with pytest.raises(SchemaError, match="unexpected schema"):
        decode_message(data, "Trajectory/1", Task)
    with pytest.raises(SchemaError, match="cannot decode"):
        decode_message(b"\xc1garbage", "Task/1", Task)
    assert schema_header(Task) == "Task/1"


def test_packed_buffer_length_is_checked() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        Trajectory(trajectory_id="x", task_id="y", env="z", token_ids=b"abc").ids()


def test_subject_table_is_consistent() -> None:
    names = {s.name for s in subjects.STREAMS}
    for spec in subjects.SUBJECTS:
        assert spec.stream in names
    durables = [c.durable for s in subjects.STREAMS for c in s.consumers]
    assert len(durables) == len(set(durables))
    assert subjects.spec_for("traj.raw.arith").message == "Episode"
    # Every older type a subject admits has a registered upgrade to the subject's type.
    for spec in subjects.SUBJECTS:
        reader = MESSAGE_TYPES[spec.message]
        for old in spec.upgrades_from:
            assert UPGRADES[reader][old][0] is MESSAGE_TYPES[old]
    assert subjects.spec_for("traj.scored.x").upgrades_from == ("ScoredTrajectory",)
    assert subjects.spec_for("weights.promoted").stream == "WEIGHTS"
    assert subjects.spec_for("dlq.TASKS").stream == "DLQ"
    with pytest.raises(KeyError):
        subjects.spec_for("nope.x")
    # workqueue streams need non-overlapping consumer filters: one durable each here
    for s in subjects.STREAMS:
        if s.retention == "workqueue":
            assert len(s.consumers) == 1


def test_request_subjects_are_outside_every_stream() -> None:
    # A stream capturing tools.call.* would store (and ack) every request instead of letting a
    # replica answer it.
    for req in subjects.REQUESTS:
        assert req.request in MESSAGE_TYPES and req.reply in MESSAGE_TYPES
        with pytest.raises(KeyError):
            subjects.spec_for(req.pattern.replace("*", "get"))
    assert subjects.tool_subject("get") == "tools.call.get"
    for bad in ("", "a.b", "a*", "x>", "a b"):
        with pytest.raises(ValueError, match="subject token"):
            subjects.tool_subject(bad)
