"""The learner's intake: grouping by group_id, every drop reason counted, duplicates, staleness bounds."""

from __future__ import annotations

import msgspec
import pytest

from slipstream.learner.intake import HELDOUT, Intake, inspect
from slipstream.learner.ledger import TrainedLedger
from slipstream.rl import DropReason, agent_advantages
from slipstream.schemas import (
    EpisodeRef,
    PolicySegment,
    ScoredEpisode,
    ScoredTrajectory,
    Trajectory,
    pack_floats,
    pack_ids,
    pack_mask,
    scored_episode_from_v1,
)

pytestmark = pytest.mark.unit

VOCAB = 259


def scored(
    tid: str,
    group: str = "g",
    *,
    size: int = 4,
    reward: float = 0.0,
    version: int = 0,
    prompt: tuple[int, ...] = (1, 2, 3),
    completion: tuple[int, ...] = (10, 11, 12),
    mask: tuple[int, ...] | None = None,
    segments: list[PolicySegment] | None = None,
    split: str = "train",
) -> ScoredEpisode:
    n = len(completion)
    traj = Trajectory(
        trajectory_id=tid,
        task_id=group.split("/")[0],
        env="arith",
        group_id=group,
        group_size=size,
        prompt_len=len(prompt),
        token_ids=pack_ids([*prompt, *completion]),
        logprobs=pack_floats([-1.0] * n),
        loss_mask=pack_mask(mask if mask is not None else [1] * n),
        segments=segments if segments is not None else [PolicySegment(version, n)],
        split=split,
    )
    # Built as a v1 trajectory and upgraded: the path every v1 producer's message takes.
    return scored_episode_from_v1(ScoredTrajectory(trajectory=traj, reward=reward, correct=reward > 0.5))


def make(max_staleness: int = 2, timeout: float = 10.0, ledger: TrainedLedger | None = None) -> Intake[str]:
    return Intake(
        max_staleness=max_staleness,
        group_timeout_s=timeout,
        vocab_size=VOCAB,
        ledger=ledger if ledger is not None else TrainedLedger(3),
    )


def test_groups_are_assembled_by_group_id_and_taken_oldest_first() -> None:
    intake = make()
    # Two groups of 3, interleaved; group b completes first.
    arrivals = [("a1", "t1/a", 0.0), ("b1", "t2/b", 1.0), ("b2", "t2/b", 0.0), ("a2", "t1/a", 1.0), ("b3", "t2/b", 1.0)]
    for tid, group, reward in arrivals:
        assert intake.offer(scored(tid, group, size=3, reward=reward), f"h-{tid}", version=0, now=0.0) == []
    assert (intake.ready_groups, intake.pending_groups, intake.in_flight) == (1, 1, 5)
    assert intake.take(2, version=0) == ([], [])  # only one complete group
    intake.offer(scored("a3", "t1/a", size=3, reward=0.5), "h-a3", version=0, now=0.0)
    groups, drops = intake.take(2, version=0)
    assert drops == []
    assert [g.key for g in groups] == ["t2/b", "t1/a"]
    assert [[m.episode_id for m in g.members] for g in groups] == [["b1", "b2", "b3"], ["a1", "a2", "a3"]]
    assert [m.handles for m in groups[0].members] == [["h-b1"], ["h-b2"], ["h-b3"]]
    assert intake.ready_groups == 0 and intake.dropped == {}


def test_a_trajectory_without_group_id_is_grouped_by_task_id() -> None:
    intake = make()
    for i, r in enumerate((0.0, 1.0)):
        s = scored(f"x{i}", "task7", size=2, reward=r)
        s.episode.group_id = ""
        intake.offer(s, i, version=0, now=0.0)
    groups, _ = intake.take(1, version=0)
    assert [g.key for g in groups] == ["task7"]


def test_every_drop_reason_is_counted_once_per_trajectory() -> None:
    ledger = TrainedLedger(2)
    ledger.commit(["old"])
    intake = make(max_staleness=1, timeout=5.0, ledger=ledger)
    cases = [
        (scored("dup", "d", size=1), DropReason.DUPLICATE),
        (scored("old", "d2", size=1), DropReason.DUPLICATE),
        (scored("bad-seg", "m", size=1, segments=[PolicySegment(0, 2)]), DropReason.MALFORMED),
        (scored("bad-vocab", "m2", size=1, completion=(10, 300)), DropReason.MALFORMED),
        (scored("ahead", "m3", size=1, version=9), DropReason.MALFORMED),
        (scored("masked", "n", size=1, mask=(0, 0, 0)), DropReason.NO_TRAINED_TOKENS),
        (scored("stale", "s", size=1, version=3), DropReason.STALE),
        (scored("eval", "h", size=1, split="heldout"), HELDOUT),
    ]
    ledger.commit(["dup"])
    results = {s.episode.episode_id: intake.offer(s, s.episode.episode_id, version=5, now=0.0) for s, _ in cases}
    for s, reason in cases:
        tid = s.episode.episode_id
        assert [(d.episode_id, d.reason, d.handles) for d in results[tid]] == [(tid, reason, (tid,))]
    # A uniform group (every reward equal) and an incomplete one.
    uniform = [intake.offer(scored(f"u{i}", "u", size=2, reward=1.0, version=5), f"u{i}", 5, 0.0) for i in range(2)]
    assert [d.reason for d in uniform[1]] == [DropReason.UNIFORM_GROUP] * 2
    assert intake.offer(scored("i0", "inc", size=3, reward=1.0, version=5), "i0", 5, now=1.0) == []
    assert intake.expire(now=5.9) == []  # 4.9 s after its first member: within the budget
    expired = intake.expire(now=6.5)
    assert [(d.episode_id, d.reason) for d in expired] == [("i0", DropReason.INCOMPLETE_GROUP)]
    late = intake.offer(scored("i1", "inc", size=3, version=5), "i1", 5, now=7.0)
    assert [d.reason for d in late] == [DropReason.INCOMPLETE_GROUP]
    assert intake.dropped == {
        "duplicate": 2,
        "malformed": 3,
        "no_trained_tokens": 1,
        "stale": 1,
        "heldout": 1,
        "uniform_group": 2,
        "incomplete_group": 2,
    }
    assert intake.in_flight == 0 and intake.ready_groups == 0 and intake.pending_groups == 0


def test_a_redelivery_of_a_held_trajectory_joins_it_and_a_committed_one_is_a_duplicate() -> None:
    ledger = TrainedLedger(2)
    intake = make(ledger=ledger)
    intake.offer(scored("a", "g", size=2, reward=0.0), "first", 0, 0.0)
    assert intake.offer(scored("a", "g", size=2, reward=0.0), "again", 0, 0.0) == []  # not a new member
    assert (intake.pending_groups, intake.in_flight, intake.redelivered) == (1, 1, 1)
    intake.offer(scored("b", "g", size=2, reward=1.0), "b", 0, 0.0)
    (group,), _ = intake.take(1, version=0)
    assert [m.handles for m in group.members] == [["first", "again"], ["b"]]
    assert sorted(intake.handles()) == ["again", "b", "first"]  # still held until the commit
    # Trained and committed: the ledger now answers for these ids.
    ledger.commit(["a", "b"])
    intake.forget(["a", "b"])
    drops = intake.offer(scored("a", "g", size=2), "third", 0, 0.0)
    assert [(d.reason, d.handles) for d in drops] == [(DropReason.DUPLICATE, ("third",))]
    assert intake.dropped == {"duplicate": 1} and intake.in_flight == 0


@pytest.mark.parametrize(
    ("max_staleness", "oldest", "stale"), [(2, 3, False), (2, 2, True), (0, 5, False), (0, 4, True)]
)
def test_staleness_bound_is_inclusive_at_arrival(max_staleness: int, oldest: int, stale: bool) -> None:
    intake = make(max_staleness=max_staleness)
    # Two segments: the oldest token decides (a rollout that spanned a weight update).
    segs = [PolicySegment(oldest, 1), PolicySegment(5, 2)]
    drops = intake.offer(scored("t", "g", size=2, segments=segs), "h", version=5, now=0.0)
    assert [d.reason for d in drops] == ([DropReason.STALE] if stale else [])


def test_queued_groups_are_rechecked_for_staleness_when_taken() -> None:
    intake = make(max_staleness=2)
    # Group x: two members at v4 (rewards differ), one at v3; group y: v3 reward 0 and v4 rewards 1, 1.
    for tid, v, r in (("x1", 4, 0.0), ("x2", 4, 1.0), ("x3", 3, 1.0)):
        intake.offer(scored(tid, "x", size=3, reward=r, version=v), tid, 5, 0.0)
    for tid, v, r in (("y1", 3, 0.0), ("y2", 4, 1.0), ("y3", 4, 1.0)):
        intake.offer(scored(tid, "y", size=3, reward=r, version=v), tid, 5, 0.0)
    assert intake.ready_groups == 2
    groups, drops = intake.take(1, version=6)  # v3 is now 3 behind: stale
    assert sorted((d.episode_id, d.reason) for d in drops) == [
        ("x3", "stale"),
        ("y1", "stale"),
        ("y2", "uniform_group"),  # what is left of y is uniform
        ("y3", "uniform_group"),
    ]
    assert [[m.episode_id for m in g.members] for g in groups] == [["x1", "x2"]]
    assert intake.dropped == {"stale": 2, "uniform_group": 2}


def test_a_member_dropped_on_arrival_still_completes_its_group() -> None:
    intake = make()
    intake.offer(scored("a", "g", size=3, reward=0.0), "a", 0, 0.0)
    assert [d.reason for d in intake.offer(scored("b", "g", size=3, mask=(0, 0, 0)), "b", 0, 0.0)] == [
        "no_trained_tokens"
    ]
    intake.offer(scored("c", "g", size=3, reward=1.0), "c", 0, 0.0)
    (group,), _ = intake.take(1, version=0)
    assert [m.episode_id for m in group.members] == ["a", "c"]
    assert intake.pending_groups == 0


def test_a_member_with_another_group_size_is_malformed() -> None:
    intake = make()
    intake.offer(scored("a", "g", size=2, reward=0.0), "a", 0, 0.0)
    drops = intake.offer(scored("b", "g", size=3, reward=1.0), "b", 0, 0.0)
    assert [d.reason for d in drops[:1]] == ["malformed"] and "group_size 3" in drops[0].detail
    # The group is complete with one survivor, whose reward has nothing to be compared with.
    assert [(d.episode_id, d.reason) for d in drops[1:]] == [("a", "uniform_group")]


def test_an_unscorable_member_is_dropped_and_left_out_of_its_groups_baseline() -> None:
    intake = make()
    rewards = {"a": 1.0, "b": 0.0, "c": 0.5, "x": 0.0}
    arrivals = {tid: scored(tid, "t/g", size=4, reward=r) for tid, r in rewards.items()}
    # The judge could not score x: its reward 0.0 is the verifier's alone, not a score to train on.
    arrivals["x"] = msgspec.structs.replace(arrivals["x"], unscorable="judge h: 0 of 3 rubrics scored: ...")
    drops = [d for tid, s in arrivals.items() for d in intake.offer(s, f"h-{tid}", version=0, now=0.0)]
    assert [(d.episode_id, d.reason, d.handles) for d in drops] == [("x", DropReason.UNSCORABLE, ("h-x",))]
    assert drops[0].detail.startswith("judge h:") and intake.dropped == {"unscorable": 1}
    (group,), _ = intake.take(1, version=0)  # x still counted as an arrival: the group completed
    survivors = [m.scored for m in group.members]
    assert [s.episode.episode_id for s in survivors] == ["a", "b", "c"]
    # Advantages against the survivors' mean (0.5), not the four-member mean (0.375) a 0 for x would give.
    advantages = [next(iter(a.values())) for a in agent_advantages(survivors)]  # one agent per episode
    assert advantages == pytest.approx([0.5, -0.5, 0.0])


def test_untrained_hands_back_pending_and_queued_members() -> None:
    intake = make()
    intake.offer(scored("p", "pending", size=2), "p", 0, 0.0)
    for tid, r in (("q1", 0.0), ("q2", 1.0)):
        intake.offer(scored(tid, "queued", size=2, reward=r), tid, 0, 0.0)
    members = intake.untrained()
    assert sorted(m.episode_id for m in members) == ["p", "q1", "q2"]
    assert (intake.in_flight, intake.ready_groups, intake.pending_groups) == (0, 0, 0)
    assert intake.dropped == {}  # handed back, not dropped


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"prompt_len": 0}, "prompt_len 0"),
        ({"prompt_len": 6}, "leaves no prompt or nothing after it"),
        ({"logprobs": pack_floats([-1.0])}, "1 logprobs for 3 tokens after the prompt"),
        ({"loss_mask": b"\x01\x02\x01"}, "0 or 1"),
        ({"loss_mask": b"\x01"}, "1 loss_mask entries"),
        ({"segments": []}, "no policy segments"),
        ({"segments": [PolicySegment(-1, 3)]}, "negative policy_version"),
        ({"token_ids": b"\x00\x01"}, "not a multiple of 4"),
        ({"logprobs": pack_floats([-1.0, float("nan"), -1.0])}, "not finite"),
        ({"routes": bytes(5), "routes_per_token": 2}, "5 route bytes are not whole tokens of routes_per_token 2"),
        ({"routes": bytes(14), "routes_per_token": 2}, "routes for 7 tokens, the sample has 6"),
    ],
)
def test_inspect_names_the_problem(change: dict[str, object], needle: str) -> None:
    s = scored("t")
    for k, v in change.items():
        setattr(s.episode.samples[0], k, v)
    assert needle in inspect(s, VOCAB).problem


def test_inspect_accepts_a_good_trajectory_and_reports_its_versions() -> None:
    s = scored("t", mask=(1, 0, 1), segments=[PolicySegment(4, 2), PolicySegment(5, 1)])
    assert inspect(s, VOCAB) == type(inspect(s, VOCAB))("", oldest_version=4, trained_tokens=2)
    bad = scored("t", reward=float("inf"))
    assert "not finite" in inspect(bad, VOCAB).problem


def multi(eid: str, *, frozen_version: int, reward: float = 0.0, **fields: object) -> ScoredEpisode:
    """A policy sample (version 5), a summary branch and a frozen helper pinned to `frozen_version`."""
    s = scored(eid, "multi", size=2, version=5, reward=reward)
    root = s.episode.samples[0]
    branch = msgspec.structs.replace(root, sample_id=f"{eid}/1", branch_of=root.sample_id, edit="summary")
    helper = msgspec.structs.replace(
        root, sample_id=f"{eid}/2", agent_id="helper", trainable=False, segments=[PolicySegment(frozen_version, 3)]
    )
    s.episode.samples = [root, branch, helper]
    for k, v in fields.items():
        setattr(s.episode, k, v)
    return s


def test_a_multi_sample_episode_is_checked_per_sample_and_staleness_ignores_frozen_samples() -> None:
    found = inspect(multi("e", frozen_version=0), VOCAB)
    # Trainable samples are at version 5; the frozen helper at 0 does not count. 3 + 3 trained tokens.
    assert found == type(found)("", oldest_version=5, trained_tokens=6)
    intake = make(max_staleness=1, timeout=5.0)
    assert intake.offer(multi("e", frozen_version=0), "e", version=5, now=0.0) == []
    assert intake.offer(multi("f", frozen_version=0, reward=1.0), "f", version=5, now=0.0) == []
    assert intake.ready_groups == 1 and intake.dropped == {}


def test_infra_errors_and_bad_branches_are_dropped_with_their_reason() -> None:
    intake = make(max_staleness=1, timeout=5.0)
    infra = multi("i", frozen_version=5, infra_error="search backend timed out")
    (d,) = intake.offer(infra, "i", version=5, now=0.0)
    assert (d.episode_id, d.reason, d.detail) == ("i", DropReason.INFRA_ERROR, "search backend timed out")
    orphan = multi("o", frozen_version=5)
    orphan.episode.samples[1].branch_of = "nowhere"
    assert "branches from 'nowhere'" in inspect(orphan, VOCAB).problem
    twice = multi("t", frozen_version=5)
    twice.episode.samples[2].sample_id = twice.episode.samples[0].sample_id
    assert "appears twice" in inspect(twice, VOCAB).problem
    stub = multi("s", frozen_version=5)
    stub.episode.body_ref = EpisodeRef(key="k", size=1, sha256="x")
    assert "stub" in inspect(stub, VOCAB).problem
    # A frozen sample may use token ids outside the policy's vocabulary.
    foreign = multi("f", frozen_version=5)
    foreign.episode.samples[2].token_ids = pack_ids([1, 2, 3, 9000, 9001, 9002])
    assert inspect(foreign, VOCAB).problem == ""


def test_a_learner_holding_groups_without_stepping_reports_the_stall() -> None:
    from slipstream.learner.config import LearnerConfig
    from slipstream.learner.service import LearnerService
    from slipstream.runtime.progress import ProgressWatch

    now = [0.0]
    svc = LearnerService(LearnerConfig())
    svc.watch = ProgressWatch(60.0, clock=lambda: now[0])
    svc.intake = make()
    assert svc._stall() is None  # nothing held: idle, not stuck
    svc.intake.offer(scored("a1", "t1/a", size=2, reward=1.0), "h-a1", version=0, now=0.0)
    assert svc._stall() is None  # held from now on
    now[0] = 59.0
    assert svc._stall() is None
    now[0] = 61.0
    reason = svc._stall()
    assert reason is not None and reason.startswith("0 group(s) ready and 1 waiting for members at step 0")
    svc.progress.step = 1  # a step was taken: progress
    assert svc._stall() is None
