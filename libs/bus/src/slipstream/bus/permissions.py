"""Least privilege on the bus: each service's NATS permissions, generated from the subject table.

A service's user may publish only what the table says it publishes, and take only from its own
durables; everything else is refused by the server ("Permissions Violation"). From one row of
`slipstream.schemas.subjects` a user gets:

- `publishers`: publish on the row's pattern;
- a durable consumer (`ConsumerSpec.service`): pull its next batch
  (`$JS.API.CONSUMER.MSG.NEXT.<stream>.<durable>`), ack / nak / term / progress its deliveries
  (`$JS.ACK.<stream>.<durable>.>`), and dead-letter into `dlq.<stream>`;
- `readers`: open ordered ephemeral consumers on the row's stream through the *named* create,
  filtered to the row's pattern (`$JS.API.CONSUMER.CREATE.<stream>.*.<pattern>`), and answer
  their flow control (`$JS.FC.<stream>.>`). The unnamed `$JS.API.CONSUMER.CREATE.<stream>` is
  never granted (its body may name any consumer), and the named create of every durable of the
  stream is denied (`publish.deny`), so a reader cannot redefine a durable such as eval-gate's
  on WEIGHTS. The server takes the consumer's name from the subject (a different name in the
  body is ignored, a different `durable_name` refused) and refuses a body whose filter differs
  from the subject's. Fan-out names are `<user>-<random>` (`fanout_name`). This needs
  nats-server 2.9 or later (nats-py 2.16 sends the named create only to a 2.x server from 2.9;
  to an older one it sends the unnamed create, which every service is refused).

Every service with a JetStream role also reads topology metadata (stream and consumer info,
never messages), which start-up checks and backlog reads need. Every service subscribes only
under its own reply prefix `_INBOX.<user>.>`: the bus connects with that inbox prefix, so no
service can read another's replies (a pull consumer's deliveries arrive on an inbox). Creating,
updating or deleting streams and durables is the admin's (the provisioning identity's) alone.

Limit: NATS matches permissions by whole subject tokens, so the `<user>-` prefix of a fan-out
name cannot be enforced; two readers of one stream could redefine each other's ephemeral views
(a denial of service on a stream both may read, never a new right). Durables are protected.

A new service row needs no edits here: a name in `publishers`, `readers`, a consumer's
`service`, or a request/reply row (`REQUESTS`) is a user with exactly those rights. A request
row's `callers` may send requests on its pattern (the replies come back to their own inbox); its
`service` subscribes to the pattern in the row's queue group only, and may publish nothing but
the reply to a request it received (NATS `allow_responses`). A service with no JetStream role
(the tool-service) gets no JetStream API rights at all. A durable's `replies_to` (the sub-agent
pool: requests through the SUBAGENTS work queue, replies on core NATS) lets its service publish
into those services' inboxes `_INBOX.<caller>.>`, nothing else outside its rows.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence

import msgspec

from slipstream.schemas import subjects as table
from slipstream.schemas.subjects import RequestSpec, StreamSpec, SubjectSpec

ADMIN = "admin"
"""The provisioning / operator identity: every subject, stream and consumer administration."""

METADATA_SUBJECTS: tuple[str, ...] = (
    "$JS.API.INFO",
    "$JS.API.STREAM.INFO.*",
    "$JS.API.CONSUMER.INFO.*.*",
    "$JS.API.CONSUMER.LIST.*",
)
"""JetStream API requests every service may make: configuration and counts, no message bodies."""

_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


class Permissions(msgspec.Struct, kw_only=True, frozen=True):
    """One NATS user's allow lists (anything not allowed is denied by the server)."""

    user: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False
    publish_deny: tuple[str, ...] = ()
    """Refused even where `publish` allows it (NATS: deny wins): other consumers' named creates."""


def inbox_prefix(user: str) -> str:
    """The reply-subject prefix a bus connecting as `user` uses (and may subscribe under)."""
    return f"_INBOX.{user}"


def fanout_name(owner: str) -> str:
    """A fresh name for one fan-out (ordered, ephemeral) consumer that `owner` creates.

    Fresh on every (re)creation: an ordered consumer that is recreated under the name of the one
    it replaces would be an update of that consumer, which the server refuses while it exists.
    """
    return f"{owner or 'fanout'}-{secrets.token_hex(8)}"


def named_create(stream: str, consumer: str, filter_subject: str) -> str:
    """The subject that creates (or updates) `consumer` on `stream` filtered to `filter_subject`."""
    return f"$JS.API.CONSUMER.CREATE.{stream}.{consumer}.{filter_subject}"


def check_user(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(
            f"service/user name {name!r} cannot be a NATS user: use lower-case letters, digits and '-' "
            "(it becomes a subject token in the user's inbox prefix)"
        )
    return name


def services(
    subjects: Sequence[SubjectSpec] = table.SUBJECTS,
    streams: Sequence[StreamSpec] = table.STREAMS,
    requests: Sequence[RequestSpec] = table.REQUESTS,
) -> tuple[str, ...]:
    """Every service the tables name, sorted: each gets one user."""
    names = {n for s in subjects for n in (*s.publishers, *s.readers)}
    names |= {c.service for s in streams for c in s.consumers}
    names |= {n for r in requests for n in (r.service, *r.callers)}
    return tuple(sorted(check_user(n) for n in names))


def service_permissions(
    service: str,
    subjects: Sequence[SubjectSpec] = table.SUBJECTS,
    streams: Sequence[StreamSpec] = table.STREAMS,
    requests: Sequence[RequestSpec] = table.REQUESTS,
) -> Permissions:
    """What `service` may publish and subscribe to, from the tables alone."""
    check_user(service)
    jetstream: list[str] = []
    deny: list[str] = []
    durables = {st.name: [c.durable for c in st.consumers] for st in streams}
    for s in subjects:
        if service in s.publishers:
            jetstream.append(s.pattern)
        if service in s.readers:
            jetstream += [named_create(s.stream, "*", s.pattern), f"$JS.FC.{s.stream}.>"]
            deny += [named_create(s.stream, d, ">") for d in durables.get(s.stream, ())]
    for st in streams:
        for c in st.consumers:
            if c.service == service:
                jetstream += [
                    f"$JS.API.CONSUMER.MSG.NEXT.{st.name}.{c.durable}",
                    f"$JS.ACK.{st.name}.{c.durable}.>",
                    table.dlq_subject(st.name),
                ]
                # A work-queue request answered on core NATS: the reply goes to the requester's inbox.
                jetstream += [inbox_prefix(caller) + ".>" for caller in c.replies_to]
    publish = [*METADATA_SUBJECTS, *jetstream] if jetstream else []
    subscribe = [inbox_prefix(service) + ".>"]
    responds = False
    for r in requests:
        if service in r.callers:
            publish.append(r.pattern)
        if service == r.service:
            subscribe.append(f"{r.pattern} {r.queue_group}")  # only inside the queue group
            responds = True
    if not publish and not responds:
        raise KeyError(f"service {service!r} appears nowhere in the subject table; known: {list(services())}")
    return Permissions(
        user=service,
        publish=tuple(dict.fromkeys(publish)),
        subscribe=tuple(dict.fromkeys(subscribe)),
        allow_responses=responds,
        publish_deny=tuple(dict.fromkeys(deny)),
    )


def admin_permissions() -> Permissions:
    return Permissions(user=ADMIN, publish=(">",), subscribe=(">",))


def all_permissions(
    subjects: Sequence[SubjectSpec] = table.SUBJECTS,
    streams: Sequence[StreamSpec] = table.STREAMS,
    requests: Sequence[RequestSpec] = table.REQUESTS,
) -> list[Permissions]:
    """The admin, then one user per service."""
    return [admin_permissions()] + [
        service_permissions(n, subjects, streams, requests) for n in services(subjects, streams, requests)
    ]


def new_passwords(users: Iterable[str]) -> dict[str, str]:
    """Fresh random passwords (the local stack makes one set per run)."""
    return {u: secrets.token_urlsafe(24) for u in users}


def publish_rules(p: Permissions) -> dict[str, list[str]]:
    """The server's `publish` block of `p`: its allow list, and its deny list where it has one."""
    if not p.publish:  # an empty allow list would mean "no restriction" to the server: deny all
        return {"deny": [">"]}
    rules = {"allow": list(p.publish)}
    if p.publish_deny:
        rules["deny"] = list(p.publish_deny)
    return rules


def _user_block(p: Permissions, password: str) -> dict[str, object]:
    publish = publish_rules(p)
    perms: dict[str, object] = {"publish": publish, "subscribe": {"allow": list(p.subscribe)}}
    if p.allow_responses:
        perms["allow_responses"] = True
    return {"user": p.user, "password": password, "permissions": perms}


def server_authorization(passwords: Mapping[str, str], perms: Sequence[Permissions] | None = None) -> str:
    """The nats-server config `authorization { users = [...] }` block for these users.

    `passwords` maps every user in `perms` (default: `all_permissions()`) to its password; a
    value may be a config variable reference such as `$NATS_PW_LEARNER` (then it is not quoted),
    which is how the Helm values take them from a Secret through the environment.
    """
    perms = all_permissions() if perms is None else perms
    missing = [p.user for p in perms if p.user not in passwords]
    if missing:
        raise KeyError(f"no password for NATS user(s) {missing}")
    lines = ["authorization {", "  users = ["]
    for p in perms:
        block = _user_block(p, passwords[p.user])
        text = json.dumps(block)
        pw = passwords[p.user]
        if pw.startswith("$"):
            text = text.replace(json.dumps(pw), pw)
        lines.append(f"    {text}")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def password_env(user: str) -> str:
    """The environment variable a deployed nats-server reads `user`'s password from."""
    return "NATS_PW_" + user.upper().replace("-", "_")
