"""The NATS permission generator on the table alone (no server): rows in, allow lists out."""

from __future__ import annotations

import pytest

from slipstream.bus.permissions import (
    METADATA_SUBJECTS,
    all_permissions,
    fanout_name,
    inbox_prefix,
    server_authorization,
    service_permissions,
    services,
)
from slipstream.schemas.subjects import REQUESTS, STREAMS, SUBJECTS, ConsumerSpec, RequestSpec, StreamSpec, SubjectSpec

pytestmark = pytest.mark.unit


def test_a_new_service_row_gets_its_users_rights_with_no_other_edit() -> None:
    subjects = (
        *SUBJECTS,
        SubjectSpec(pattern="search.hits.>", message="Hit", stream="SEARCH", publishers=("searcher",)),
    )
    streams = (
        *STREAMS,
        StreamSpec(
            name="SEARCH",
            retention="workqueue",
            consumers=(ConsumerSpec(durable="ranker", filter_subject="search.hits.>", service="ranker"),),
        ),
    )
    requests = (
        *REQUESTS,
        RequestSpec(pattern="search.ask.*", request="Q", reply="A", queue_group="searcher", service="searcher",
                    callers=("ranker",)),
    )  # fmt: skip
    assert {"searcher", "ranker"} <= set(services(subjects, streams, requests))
    searcher = service_permissions("searcher", subjects, streams, requests)
    assert "search.hits.>" in searcher.publish and "traj.raw.>" not in searcher.publish
    assert searcher.subscribe == (inbox_prefix("searcher") + ".>", "search.ask.* searcher")
    assert searcher.allow_responses
    ranker = service_permissions("ranker", subjects, streams, requests)
    assert {"$JS.API.CONSUMER.MSG.NEXT.SEARCH.ranker", "$JS.ACK.SEARCH.ranker.>", "dlq.SEARCH", "search.ask.*"} <= set(
        ranker.publish
    )
    assert not ranker.allow_responses and ranker.subscribe == (inbox_prefix("ranker") + ".>",)


def test_no_service_may_administer_streams_or_use_another_inbox() -> None:
    for p in all_permissions()[1:]:
        assert not [s for s in p.publish if s.startswith(("$JS.API.STREAM.CREATE", "$JS.API.STREAM.DELETE", ">"))]
        assert not [s for s in p.publish if "DELETE" in s or "PURGE" in s or "UPDATE" in s]
        assert [s for s in p.subscribe if s.startswith("_INBOX")] == [inbox_prefix(p.user) + ".>"], p.user


def test_readers_create_only_named_filtered_views_and_never_a_durable() -> None:
    for p in all_permissions()[1:]:
        creates = [s for s in p.publish if s.startswith("$JS.API.CONSUMER.CREATE")]
        # Never the unnamed create (its body may name a durable), never an unfiltered named one.
        assert all(len(s.split(".")) >= 7 and s.split(".")[5] == "*" for s in creates), (p.user, creates)
        assert not [s for s in p.publish if "DURABLE" in s], p.user
    worker = service_permissions("rollout-worker")
    assert {
        "$JS.API.CONSUMER.CREATE.WEIGHTS.*.weights.announce",
        "$JS.API.CONSUMER.CREATE.WEIGHTS.*.weights.promoted",
    } <= set(worker.publish)
    assert worker.publish_deny == ("$JS.API.CONSUMER.CREATE.WEIGHTS.eval-gate.>",)
    source = service_permissions("task-source")
    assert "$JS.API.CONSUMER.CREATE.LEARNER.*.learner.step" in source.publish
    assert "$JS.API.CONSUMER.CREATE.WEIGHTS.*.weights.promoted" not in source.publish
    # eval-gate reads WEIGHTS too: even its own durable is the admin's to define.
    assert "$JS.API.CONSUMER.CREATE.WEIGHTS.eval-gate.>" in service_permissions("eval-gate").publish_deny
    assert service_permissions("reward-model").publish_deny == ()  # reads no fan-out view
    conf = server_authorization({p.user: "pw" for p in all_permissions()})
    assert '"deny": ["$JS.API.CONSUMER.CREATE.WEIGHTS.eval-gate.>"]' in conf


def test_a_new_durable_on_a_read_stream_is_denied_to_its_readers() -> None:
    streams = tuple(
        StreamSpec(name=s.name, retention=s.retention, consumers=(*s.consumers, ConsumerSpec(
            durable="auditor", filter_subject="weights.>", service="auditor")))
        if s.name == "WEIGHTS" else s
        for s in STREAMS
    )  # fmt: skip
    learner = service_permissions("learner", SUBJECTS, streams, REQUESTS)
    assert set(learner.publish_deny) == {
        "$JS.API.CONSUMER.CREATE.WEIGHTS.eval-gate.>",
        "$JS.API.CONSUMER.CREATE.WEIGHTS.auditor.>",
    }


def test_fanout_names_are_the_owners_and_fresh() -> None:
    names = {fanout_name("learner") for _ in range(100)}
    assert len(names) == 100 and all(n.startswith("learner-") for n in names)
    assert fanout_name("").startswith("fanout-")  # a bus without a user (a dev server without auth)


def test_a_service_without_a_jetstream_role_gets_no_jetstream_rights() -> None:
    tool = service_permissions("tool-service")
    assert not set(METADATA_SUBJECTS) & set(tool.publish)
    assert tool.publish == () and tool.allow_responses
    # An empty allow list would mean "anything" to nats-server: the config denies all instead.
    assert '"publish": {"deny": [">"]}' in server_authorization({p.user: "pw" for p in all_permissions()})


def test_unknown_services_and_unusable_names_are_refused_by_name() -> None:
    with pytest.raises(KeyError, match="'nobody' appears nowhere in the subject table"):
        service_permissions("nobody")
    with pytest.raises(ValueError, match="cannot be a NATS user"):
        service_permissions("Bad.Name")
    with pytest.raises(KeyError, match=r"no password for NATS user\(s\) \['learner'\]"):
        server_authorization({p.user: "pw" for p in all_permissions() if p.user != "learner"})
