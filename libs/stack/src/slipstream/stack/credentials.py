"""The local stack's per-run credentials: one NATS user and one Redis ACL user per service, plus an admin.

A stack that starts its own nats-server and redis-server makes fresh random passwords for every
run, starts the servers with the users `slipstream.bus.permissions` and `slipstream.control.acl`
generate from the subject table and the control-plane key table, and gives each service only its
own user (through SLIPSTREAM_BUS__USER / __PASSWORD and a Redis URL naming its ACL user). The
admin passwords, for provisioning and for the CLI's read-outs (`status`, `top`, `promote`), are
kept in `<run_dir>/credentials.json`, readable by its owner only; `stack.json` and the logs never
hold a password.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream.bus.config import BusConfig
from slipstream.bus.permissions import ADMIN, all_permissions, new_passwords, server_authorization
from slipstream.control.acl import ADMIN as REDIS_ADMIN
from slipstream.control.acl import acl_file, with_user

if TYPE_CHECKING:
    from slipstream.stack.stackfile import StackFile

FILE = "credentials.json"


@dataclass(frozen=True)
class Credentials:
    nats: Mapping[str, str]
    """NATS user -> password: the admin and every service in the subject table."""
    redis: Mapping[str, str]
    """Redis user -> password: `default` (the admin) and every service of the stack."""

    @classmethod
    def generate(cls, services: Iterable[str]) -> Credentials:
        return cls(
            nats=new_passwords(p.user for p in all_permissions()),
            redis=new_passwords((REDIS_ADMIN, *services)),
        )

    def nats_authorization(self) -> str:
        return server_authorization(self.nats)

    def redis_acl(self, run_id: str) -> str:
        services = {u: p for u, p in self.redis.items() if u != REDIS_ADMIN}
        return acl_file(self.redis[REDIS_ADMIN], services, run_id)

    def service_env(self, service: str, redis_url: str) -> dict[str, str]:
        """The variables that make `service` connect as its own users."""
        if service not in self.nats:
            raise KeyError(
                f"{service!r} has no NATS user: it is not in the subject table (slipstream.schemas.subjects)"
            )
        return {
            "SLIPSTREAM_BUS__USER": service,
            "SLIPSTREAM_BUS__PASSWORD": self.nats[service],
            "SLIPSTREAM_SERVICE__REDIS_URL": with_user(redis_url, service, self.redis[service]),
        }

    def admin_bus(self, url: str, **kw: Any) -> BusConfig:
        return BusConfig(url=url, user=ADMIN, password=self.nats[ADMIN], **kw)

    def admin_redis_url(self, url: str) -> str:
        return with_user(url, REDIS_ADMIN, self.redis[REDIS_ADMIN])

    def save(self, run_dir: Path) -> Path:
        path = run_dir / FILE
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"nats": dict(self.nats), "redis": dict(self.redis)}, f, indent=2)
        return path

    @classmethod
    def load(cls, run_dir: str | Path) -> Credentials | None:
        """The run's credentials, or None for a stack that ran without them (external servers)."""
        path = Path(run_dir) / FILE
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        return cls(nats=dict(data["nats"]), redis=dict(data["redis"]))


def bus_config_for(info: StackFile, **kw: Any) -> BusConfig:
    """A BusConfig for a CLI read-out of the stack described by `info` (stack.json): admin when it has users."""
    url = info.server_url("nats")
    creds = Credentials.load(info.run_dir) if info.run_dir else None
    return creds.admin_bus(url, **kw) if creds is not None else BusConfig(url=url, **kw)


def redis_url_for(info: StackFile) -> str:
    """The stack's Redis URL for a CLI read-out, authenticated as the admin when it has users."""
    url = info.server_url("redis")
    creds = Credentials.load(info.run_dir) if info.run_dir else None
    return creds.admin_redis_url(url) if creds is not None else url
