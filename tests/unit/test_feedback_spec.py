"""Feedback posts, implicit signals, the reward spec and the in-memory pending stage (issue 16, item 2).

The pending stage's full contract (both stores, Redis included) is tests/contract/test_pending.py,
the endpoint's tests/integration/test_serve_feedback.py. Here: parsing and idempotency keys, the
spec's components on hand-computed numbers, the releaser over the in-memory bus and a local
object store, and a flush the store refused being retried.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.bus import BusConfig, connect_bus
from slipstream.envs import EnvError, get_env, task_of
from slipstream.reward_model.scorer import Scorer
from slipstream.schemas import Episode, FeedbackSignal, encode
from slipstream.serve import Implicit, MemoryPending, PendingPolicy, Releaser, RequestError, parse_feedback
from slipstream.serve.feedback import call_id_of, last_user_text
from slipstream.store import LocalObjectStore
from slipstream.store.episodes import episode_key, load

pytestmark = pytest.mark.unit


def sig(key: str, value: float | bool | str, *, source: str = "user", at: float = 0.0, fid: str = "") -> FeedbackSignal:
    return FeedbackSignal(key=key, value=value, source=source, feedback_id=fid or f"{key}-{at}-{source}", at=at)


# ------------------------------------------------------------------------------ posts
def test_a_post_names_one_target_and_gets_a_stable_id() -> None:
    a = parse_feedback({"completion_id": "chatcmpl-abc", "key": "accepted", "value": True}, now=1.0)
    b = parse_feedback({"completion_id": "abc", "key": "accepted", "value": True}, now=2.0)
    assert a.kind == "completion_id" and a.target_id == "abc" and a.signal.target == "completion:abc"
    assert a.signal.feedback_id == b.signal.feedback_id  # same target, key, source, value: one signal
    c = parse_feedback({"completion_id": "abc", "key": "accepted", "value": False}, now=2.0)
    assert c.signal.feedback_id != a.signal.feedback_id
    d = parse_feedback({"session_id": "s", "key": "rating", "value": 4, "source": "app", "feedback_id": "x1"}, now=3.0)
    assert d.signal.feedback_id == "x1" and d.signal.value == 4.0 and d.signal.source == "app"
    assert call_id_of("cmpl-xyz") == "xyz" and call_id_of("xyz") == "xyz"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"key": "k", "value": 1}, "completion_id"),  # no target
        ({"completion_id": "a", "session_id": "s", "key": "k", "value": 1}, "completion_id"),  # two
        ({"completion_id": "a", "value": 1}, "key"),
        ({"completion_id": "a", "key": "k"}, "value"),
        ({"completion_id": "a", "key": "k", "value": [1]}, "value"),
        ({"completion_id": "a", "key": "k", "value": float("nan")}, "value"),
        ({"completion_id": "a", "key": "k", "value": 1, "source": 3}, "source"),
        ({"completion_id": "a", "key": "k", "value": 1, "colour": "red"}, "colour"),
        ({"episode_id": "", "key": "k", "value": 1}, "episode_id"),
    ],
)
def test_a_bad_post_is_refused_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(RequestError) as err:
        parse_feedback(body, now=0.0)
    assert err.value.status == 400 and err.value.param == param


def test_implicit_signals_from_the_next_user_message() -> None:
    imp = Implicit("followed_up", "dissatisfied", [r"\bwrong\b", r"try again"])
    happy = {s.key: s.value for s in imp.signals("c1", "thanks, and now the next one", now=5.0)}
    assert happy == {"followed_up": 1.0, "dissatisfied": 0.0}
    sad = imp.signals("c1", "That is WRONG.", now=5.0)
    assert {s.key: s.value for s in sad} == {"followed_up": 1.0, "dissatisfied": 1.0}
    assert all(s.source == "implicit" and s.target == "completion:c1" for s in sad)
    assert not Implicit("", "", []).enabled
    with pytest.raises(ValueError, match="dissatisfied_patterns"):
        Implicit("f", "d", ["(unclosed"])
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert last_user_text(msgs) == "c" and last_user_text([{"role": "system", "content": "x"}]) is None


# ------------------------------------------------------------------------------ the reward spec
SPEC = {
    "version": "thumbs-v2",
    "components": [
        {"name": "accepted", "signal": "accepted", "map": {"true": 1.0, "false": -0.25}, "weight": 2.0},
        {"name": "dissatisfied", "signal": "dissatisfied", "scale": -0.5, "source": "implicit"},
        {"name": "rating", "signal": "stars", "scale": 0.25, "offset": -0.75},
        {"name": "latency", "signal": "latency_s", "scale": -0.1, "default": 0.0},
    ],
}


def score(episode_signals: list[FeedbackSignal], spec: dict | None = None) -> tuple[dict[str, float], str, str]:
    env = get_env("serve", **(spec or SPEC))
    ep = Episode(episode_id="serve/s/0", task_id="serve/s/0", env="serve", feedback=episode_signals)
    s = env.score(task_of(ep), ep)
    return s.components, s.unscorable, env.scorer_version


def test_the_spec_turns_signals_into_named_components() -> None:
    comps, unscorable, version = score(
        [
            sig("accepted", False, at=1.0),
            sig("accepted", True, at=2.0),  # the latest signal of a key wins
            sig("dissatisfied", 1.0, source="implicit", at=1.0),
            sig("dissatisfied", 1.0, source="user", at=3.0),  # wrong source: ignored
            sig("stars", 5, at=1.0),
        ]
    )
    assert unscorable == ""
    # accepted: 2 * 1.0; dissatisfied: -0.5 * 1; rating: 0.25 * 5 - 0.75; latency absent -> default 0 * -0.1... = 0
    assert comps == pytest.approx({"accepted": 2.0, "dissatisfied": -0.5, "rating": 0.5, "latency": 0.0})
    assert version.startswith("serve@1/thumbs-v2+")
    comps, _, _ = score([sig("accepted", False), sig("latency_s", 3.0)])
    assert comps == pytest.approx({"accepted": -0.5, "latency": -0.3})


def test_an_episode_whose_signals_the_spec_does_not_use_is_masked_not_zero() -> None:
    spec = {"version": "v9", "components": [{"name": "accepted", "signal": "accepted", "map": {"true": 1.0}}]}
    comps, unscorable, _ = score([sig("followed_up", 1.0)], spec)
    assert comps == {} and unscorable.startswith("masked") and "followed_up" in unscorable
    comps, unscorable, _ = score([sig("accepted", "maybe")], spec)  # a label the map lacks: absent
    assert comps == {} and unscorable
    comps, unscorable, _ = score([], spec)
    assert unscorable
    # In the reward-model the masked episode is passed on marked unscorable (the learner drops
    # it from its group's baseline), never scored 0.
    scorer = Scorer({"serve": spec})
    masked, _ = scorer.score(Episode(episode_id="e", task_id="e", env="serve", feedback=[sig("x", 1.0)]), now=0.0)
    assert masked.unscorable.startswith("masked") and masked.components == {}
    scored, _ = scorer.score(
        Episode(episode_id="e", task_id="e", env="serve", feedback=[sig("accepted", True)]), now=0.0
    )
    assert (
        scored.reward == 1.0
        and scored.components == {"accepted": 1.0}
        and scored.scorer_version.startswith("serve@1/v9")
    )


@pytest.mark.parametrize(
    "spec",
    [
        {"components": [{"name": "a", "signal": "a"}, {"name": "a", "signal": "b"}]},
        {"components": []},
        {"components": [{"name": "", "signal": "a"}]},
        {"components": [{"name": "a", "signal": "a", "weight": float("inf")}]},
        {"components": [{"name": "a", "signal": "a", "colour": 1}]},
        {"version": ""},
    ],
)
def test_a_bad_spec_is_a_config_error(spec: dict) -> None:
    with pytest.raises(EnvError):
        get_env("serve", **spec)


def test_the_default_spec_has_a_plain_scorer_version() -> None:
    assert get_env("serve").scorer_version == "serve@1/v1"


# ------------------------------------------------------------------------------ pending + releaser
def _body(store: LocalObjectStore, eid: str) -> str:
    key = episode_key("r", eid)
    store.put(key, encode(Episode(episode_id=eid, task_id=eid, env="serve", run_id="r", group_id=eid)))
    return key


async def test_the_releaser_publishes_groups_with_their_signals(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    # A broker of its own (memory brokers are per URL and process-wide): under xdist the serve
    # feedback test, run earlier in the same worker, left its released episode on the default one.
    bus = await connect_bus(BusConfig(type="memory", url="memory://feedback-spec-releaser"), name="test")
    await bus.ensure_streams()
    consumer = await bus.consumer("reward-model", Episode)
    now = [100.0]
    pending = MemoryPending(PendingPolicy(env="serve", run_id="r", group_size=2))
    rel = Releaser(pending, store, bus, clock=lambda: now[0])
    for i in range(3):
        eid = f"serve/unit-s{i}/0"  # ids of their own: in-process memory buses share one dedup window
        await pending.note_call(f"c{i}", f"s{i}", eid)
        if i < 2:
            await pending.add_feedback(eid, sig("accepted", True, fid=f"f{i}"), now[0])
        await pending.flushed(eid, _body(store, eid), now[0] + 10, now[0])
    assert await rel.step() == 2  # one full group; the third has no signal yet
    now[0] = 111.0
    assert await rel.step() == 0 and rel.masked == 1  # the third reached its deadline unrated
    got = [d.msg for d in await consumer.fetch(10, timeout=0.5)]
    assert sorted(e.episode_id for e in got) == ["serve/unit-s0/0", "serve/unit-s1/0"]
    assert {e.group_id for e in got} == {"serve-r-1"} and sorted(e.group_index for e in got) == [0, 1]
    assert all(e.is_stub() and e.group_size == 2 for e in got)
    full = load(store, got[0])
    assert [s.key for s in full.feedback] == ["accepted"] and full.group_id == "serve-r-1"
    await bus.close()


class FlakySink:
    """A sink whose store is away for the first `fail` puts (fault injection)."""

    def __init__(self, fail: int) -> None:
        self.fail = fail
        self.episodes: list[Episode] = []

    async def put(self, episode: Episode) -> str:
        if self.fail > 0:
            self.fail -= 1
            raise OSError("store away")
        self.episodes.append(episode)
        return f"k/{episode.episode_id}"


async def test_an_episode_the_store_refused_is_kept_and_stored_on_the_next_sweep() -> None:
    from slipstream.engine.interface import SamplingParams
    from slipstream.serve import CallRecord, Recorder

    pending = MemoryPending(PendingPolicy())
    sink = FlakySink(fail=1)
    rec = Recorder(sink, session_idle_s=1, clock=lambda: 0.0, pending=pending)
    call = CallRecord(
        call_id="c1",
        session_id="s",
        endpoint="chat",
        model="m",
        created=0.0,
        finished_at=0.0,
        prompt_ids=[1],
        completion_ids=[2],
        logprobs=[-0.1],
        segments=[(0, 1)],
        finish_reason="stop",
        params=SamplingParams(),
        template_hash="",
    )
    assert await rec.record(call) == "serve/s/0"
    await rec.flush("s")
    assert sink.episodes == [] and rec.flush_failures == 1 and await pending.state("serve/s/0") == "open"
    assert await rec.retry_failed() == 0
    assert [e.episode_id for e in sink.episodes] == ["serve/s/0"] and await pending.state("serve/s/0") == "pending"
