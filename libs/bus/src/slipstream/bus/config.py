"""Bus configuration section (`[bus]`): which backend, where the server is, who connects, publish/fetch bounds."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

Doc = msgspec.Meta


class BusConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Annotated[
        Literal["nats", "memory"], Doc(description="Bus backend: 'nats' (JetStream) or 'memory' (one process).")
    ] = "nats"
    url: Annotated[str, Doc(description="NATS server URL(s), comma-separated.")] = "nats://127.0.0.1:4222"
    connect_timeout_s: Annotated[float, Doc(description="Timeout of one connection attempt.")] = 2.0
    ack_timeout_s: Annotated[
        float, Doc(description="Longest wait for a JetStream publish ack before it is retried or fails.")
    ] = 10.0
    max_inflight_bytes: Annotated[int, Doc(description="Bound on bytes published but not yet acked.")] = (
        32 * 1024 * 1024
    )
    max_inflight_msgs: Annotated[int, Doc(description="Bound on messages published but not yet acked.")] = 4096
    fetch_batch: Annotated[int, Doc(description="Messages per pull-consumer fetch.")] = 64
    fetch_timeout_s: Annotated[float, Doc(description="Longest wait of one fetch when the stream is empty.")] = 1.0
    stream_storage: Annotated[
        Literal["file", "memory"], Doc(description="JetStream storage for streams created at start-up.")
    ] = "file"
    stream_replicas: Annotated[int, Doc(description="JetStream replicas for streams created at start-up.")] = 1
    publish_retries: Annotated[
        int, Doc(description="Re-sends of a publish whose ack was lost (same Nats-Msg-Id, so the stream dedups it).")
    ] = 2
    connect_budget_s: Annotated[
        float, Doc(description="How long the first connection is retried before BusUnavailable is raised.")
    ] = 15.0
    reconnect_wait_s: Annotated[float, Doc(description="Pause between reconnection attempts (forever).")] = 1.0
    ping_interval_s: Annotated[
        float,
        Doc(
            description="Seconds between pings to the server; a link cut without a reset (a partitioned host) is "
            "noticed after `max_outstanding_pings` unanswered ones and the client moves to another URL.",
            gt=0,
        ),
    ] = 120.0
    max_outstanding_pings: Annotated[
        int, Doc(description="Unanswered pings after which the connection is taken as dead.", ge=1)
    ] = 2
    drain_timeout_s: Annotated[float, Doc(description="Longest wait to drain subscriptions and acks on close.")] = 5.0
    user: Annotated[
        str,
        Doc(
            description="NATS user to connect as (one per service, permissions from the subject table); "
            "empty connects without credentials."
        ),
    ] = ""
    password: Annotated[
        str, Doc(description="Password of `user` (from a Secret or the local stack; never logged or printed).")
    ] = ""
    password_file: Annotated[
        str, Doc(description="File holding the password of `user` (a mounted Secret); used when `password` is empty.")
    ] = ""
    tls_ca_file: Annotated[
        str, Doc(description="CA bundle to verify the server's TLS certificate; set (or use tls://) to require TLS.")
    ] = ""
    tls_cert_file: Annotated[str, Doc(description="Client certificate for mutual TLS (with `tls_key_file`).")] = ""
    tls_key_file: Annotated[str, Doc(description="Private key of `tls_cert_file`.")] = ""
    memory_max_payload: Annotated[
        int, Doc(description="Largest message the memory backend accepts (NATS reads max_payload from the server).")
    ] = 1024 * 1024

    def resolved_password(self) -> str:
        """`password`, or the contents of `password_file` (trailing newline stripped)."""
        if self.password or not self.password_file:
            return self.password
        try:
            return Path(self.password_file).read_text().rstrip("\r\n")
        except OSError as exc:
            raise ValueError(f"[bus] password_file {self.password_file!r} cannot be read: {exc}") from exc

    def nats_options(self) -> dict[str, Any]:
        """`nats.connect` keyword arguments for this config's identity: user, password, inbox prefix, TLS.

        With a user, replies come back under the user's own prefix (`_INBOX.<user>`), the only
        place its permissions let it subscribe (slipstream.bus.permissions).
        """
        from slipstream.bus.permissions import inbox_prefix

        out: dict[str, Any] = {}
        if self.user:
            out = {"user": self.user, "password": self.resolved_password(), "inbox_prefix": inbox_prefix(self.user)}
        tls = self.tls_context()
        if tls is not None:
            out["tls"] = tls
        return out

    def wants_tls(self) -> bool:
        return bool(self.tls_ca_file or self.tls_cert_file) or any(
            u.strip().startswith("tls://") for u in self.url.split(",")
        )

    def tls_context(self) -> ssl.SSLContext | None:
        """The client TLS context, or None for plain TCP."""
        if not self.wants_tls():
            return None
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("[bus] tls_cert_file and tls_key_file go together (mutual TLS); set both or neither")
        try:
            ctx = ssl.create_default_context(cafile=self.tls_ca_file or None)
            if self.tls_cert_file:
                ctx.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"[bus] TLS files cannot be loaded: {exc}") from exc
        return ctx
