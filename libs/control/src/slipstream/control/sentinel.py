"""A Redis primary found through Sentinel: the `redis+sentinel://` form of `[service] redis_url`.

    redis+sentinel://[user:password@]host1:26379,host2:26379,host3:26379/<service>[/<db>][?min_replicas=N]

names the Sentinels (any of them answers), the name they monitor the primary under, the
database, and how many replicas must have a lease write before it counts (`min_replicas`,
default 1: a Sentinel set-up has a replica, and a grant only the dead primary held would be
granted again after the failover). The user and password are the data nodes' (Redis ACL); the
Sentinels are asked without credentials.

The client asks a Sentinel for the primary when it connects and again whenever a connection
fails, so after a failover the next operation (or the one retry `ControlClient` allows) reaches
the promoted replica; a connection to a node demoted since is refused by redis-py's Sentinel pool
as a connection error, never written to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote

import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel

SCHEME = "redis+sentinel://"
DEFAULT_PORT = 26379


@dataclass(frozen=True)
class SentinelTarget:
    """A parsed `redis+sentinel://` URL."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    min_replicas: int = 1

    def redacted(self) -> str:
        """The URL without its password, for logs and errors."""
        who = f"{self.username or ''}:***@" if self.password else (f"{self.username}@" if self.username else "")
        where = ",".join(f"{h}:{p}" for h, p in self.sentinels)
        return f"{SCHEME}{who}{where}/{self.service}/{self.db}"


def is_sentinel_url(url: str) -> bool:
    return url.startswith(SCHEME)


def parse_sentinel_url(url: str) -> SentinelTarget:
    """Parse a `redis+sentinel://` URL; ValueError names the URL (password hidden) and what is wrong."""
    if not is_sentinel_url(url):
        raise ValueError(f"not a {SCHEME} URL: {url.split('@')[-1]!r}")
    rest, _, query = url[len(SCHEME) :].partition("?")
    userinfo, at, hostpath = rest.rpartition("@")
    if not at:
        userinfo, hostpath = "", rest
    hosts, _, path = hostpath.partition("/")
    shown = f"{SCHEME}{'***@' if at else ''}{hostpath}"
    sentinels: list[tuple[str, int]] = []
    for entry in filter(None, (h.strip() for h in hosts.split(","))):
        host, colon, port = entry.rpartition(":")
        if not colon:
            host, port = entry, str(DEFAULT_PORT)
        if not host or not port.isdigit():
            raise ValueError(f"redis_url {shown!r}: sentinel {entry!r} is not host:port")
        sentinels.append((host, int(port)))
    if not sentinels:
        raise ValueError(f"redis_url {shown!r}: names no sentinel")
    parts = [p for p in path.split("/") if p]
    if not parts:
        raise ValueError(f"redis_url {shown!r}: no service name (…/<service>/<db>)")
    if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError(f"redis_url {shown!r}: the path must be /<service>[/<db>], got /{path}")
    options = parse_qs(query)
    unknown = sorted(set(options) - {"min_replicas"})
    if unknown:
        raise ValueError(f"redis_url {shown!r}: unknown option(s) {unknown}; known: ['min_replicas']")
    raw = options.get("min_replicas", ["1"])[-1]
    if not raw.isdigit():
        raise ValueError(f"redis_url {shown!r}: min_replicas must be an integer >= 0, got {raw!r}")
    user, _, password = userinfo.partition(":")
    return SentinelTarget(
        sentinels=tuple(sentinels),
        service=parts[0],
        db=int(parts[1]) if len(parts) == 2 else 0,
        username=unquote(user) or None,
        password=unquote(password) or None,
        min_replicas=int(raw),
    )


class SentinelClient:
    """The Sentinels of one target and a client of the primary they name; `close()` closes both."""

    def __init__(self, target: SentinelTarget, **kwargs: Any) -> None:
        timeout = kwargs.get("socket_timeout")
        self.sentinel = Sentinel(
            list(target.sentinels),
            sentinel_kwargs={"socket_timeout": timeout, "socket_connect_timeout": timeout},
        )
        # `kwargs` go to each data connection (timeouts, retry, decoding).
        self.primary: aioredis.Redis = self.sentinel.master_for(
            target.service, db=target.db, username=target.username, password=target.password, **kwargs
        )

    async def close(self) -> None:
        await self.primary.aclose()
        for s in self.sentinel.sentinels:
            await s.aclose()
