"""The `redis+sentinel://` form of `[service] redis_url`: what it names, what it refuses, what it hides."""

from __future__ import annotations

import pytest

from slipstream.control import redact_url
from slipstream.control.acl import with_user
from slipstream.control.sentinel import SentinelTarget, parse_sentinel_url


def test_every_part_of_a_sentinel_url_is_read() -> None:
    t = parse_sentinel_url("redis+sentinel://learner:s%40cret@10.0.0.1:26380,10.0.0.2,h3:1/primary/2?min_replicas=2")
    assert t == SentinelTarget(
        sentinels=(("10.0.0.1", 26380), ("10.0.0.2", 26379), ("h3", 1)),
        service="primary",
        db=2,
        username="learner",
        password="s@cret",
        min_replicas=2,
    )
    plain = parse_sentinel_url("redis+sentinel://a:1/slipstream")
    assert (plain.db, plain.username, plain.password, plain.min_replicas) == (0, None, None, 1)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel:///slipstream/0", "names no sentinel"),
        ("redis+sentinel://a:1", "no service name"),
        ("redis+sentinel://a:1/s/x", "the path must be"),
        ("redis+sentinel://a:port/s", "is not host:port"),
        ("redis+sentinel://a:1/s?replicas=1", "unknown option"),
        ("redis+sentinel://a:1/s?min_replicas=-1", "min_replicas must be an integer"),
    ],
)
def test_a_bad_sentinel_url_is_refused_naming_the_problem(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_sentinel_url(url)


def test_the_password_never_shows() -> None:
    url = "redis+sentinel://learner:hunter2@10.0.0.1:26380,10.0.0.2:26380/slipstream/0"
    assert redact_url(url) == "redis+sentinel://learner:***@10.0.0.1:26380,10.0.0.2:26380/slipstream/0"
    with pytest.raises(ValueError) as bad:
        parse_sentinel_url("redis+sentinel://learner:hunter2@a:1/s/x")
    assert "hunter2" not in str(bad.value)


def test_a_services_acl_user_goes_into_a_sentinel_url_as_into_a_plain_one() -> None:
    url = with_user("redis+sentinel://old:pw@10.0.0.1:26379,10.0.0.2:26379/slipstream/0", "learner", "p/w")
    assert url == "redis+sentinel://learner:p%2Fw@10.0.0.1:26379,10.0.0.2:26379/slipstream/0"
    t = parse_sentinel_url(url)
    assert (t.username, t.password, t.sentinels[1]) == ("learner", "p/w", ("10.0.0.2", 26379))
    assert with_user("redis://redis:6379/0", "learner", "x") == "redis://learner:x@redis:6379/0"
