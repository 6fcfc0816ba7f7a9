"""TLS on the bus: nats-server with a self-signed certificate, services verifying it, with and without client certs.

The certificate is made here with `cryptography` (a CA, and a server certificate for 127.0.0.1
signed by it). A bus that trusts the CA connects, publishes and consumes as its user; one that
does not trust it cannot connect; with client certificates required, a bus without one cannot
connect either.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from slipstream.bus import BusConfig, BusUnavailable, connect_bus
from slipstream.bus.permissions import ADMIN, all_permissions, new_passwords, server_authorization
from slipstream.schemas import Task
from slipstream.schemas.subjects import tasks_subject
from slipstream.stack import Server, start_nats
from slipstream.stack.servers import TlsFiles

pytestmark = pytest.mark.integration


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


def _cert(
    subject: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer[0].subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    if issuer is None:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    else:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
    return builder.sign(issuer[1] if issuer else key, hashes.SHA256())


class Pki:
    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = _cert("slipstream-test-ca", ca_key, None)
        self.ca = root / "ca.pem"
        self.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
        self.files: dict[str, tuple[Path, Path]] = {}
        for name in ("server", "client"):
            key = ec.generate_private_key(ec.SECP256R1())
            cert = _cert(name, key, (ca, ca_key))
            cert_path, key_path = root / f"{name}.pem", root / f"{name}.key"
            cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
            _write_key(key_path, key)
            self.files[name] = (cert_path, key_path)
        other_key = ec.generate_private_key(ec.SECP256R1())
        self.untrusted_ca = root / "other-ca.pem"
        self.untrusted_ca.write_bytes(_cert("someone-else", other_key, None).public_bytes(serialization.Encoding.PEM))


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "pki")


def _start(tmp_path: Path, pki: Pki, *, mutual: bool) -> tuple[Server, dict[str, str]]:
    passwords = new_passwords(p.user for p in all_permissions())
    cert, key = pki.files["server"]
    tls = TlsFiles(cert=cert, key=key, client_ca=pki.ca if mutual else None)
    srv = start_nats(tmp_path / "nats", tmp_path / "logs", authorization=server_authorization(passwords), tls=tls)
    return srv, passwords


@pytest.fixture
def tls_nats(tmp_path: Path, pki: Pki) -> Iterator[tuple[Server, dict[str, str]]]:
    srv, passwords = _start(tmp_path, pki, mutual=False)
    try:
        yield srv, passwords
    finally:
        srv.stop()


async def test_a_service_that_trusts_the_ca_works_over_tls(tls_nats: tuple[Server, dict[str, str]], pki: Pki) -> None:
    srv, pw = tls_nats
    assert srv.url.startswith("tls://")
    admin = await connect_bus(BusConfig(url=srv.url, user=ADMIN, password=pw[ADMIN], tls_ca_file=str(pki.ca)), name="a")
    source = await connect_bus(
        BusConfig(url=srv.url, user="task-source", password=pw["task-source"], tls_ca_file=str(pki.ca)), name="ts"
    )
    worker = await connect_bus(
        BusConfig(url=srv.url, user="rollout-worker", password=pw["rollout-worker"], tls_ca_file=str(pki.ca)), name="w"
    )
    try:
        await admin.ensure_streams()
        await source.publish(tasks_subject("arith"), Task(task_id="t1", env="arith", prompt="1+1"))
        consumer = await worker.consumer("rollout-worker", Task)
        got = await consumer.fetch(4, 2.0)
        assert [d.msg.task_id for d in got] == ["t1"]
        for d in got:
            await d.ack()
        await consumer.close()
    finally:
        for bus in (worker, source, admin):
            await bus.close()


async def test_a_service_that_does_not_trust_the_certificate_cannot_connect(
    tls_nats: tuple[Server, dict[str, str]], pki: Pki
) -> None:
    srv, pw = tls_nats
    cfg = BusConfig(
        url=srv.url, user="learner", password=pw["learner"], tls_ca_file=str(pki.untrusted_ca), connect_budget_s=2.0
    )
    with pytest.raises(BusUnavailable):
        await connect_bus(cfg, name="learner")


async def test_mutual_tls_needs_a_client_certificate(tmp_path: Path, pki: Pki) -> None:
    srv, pw = _start(tmp_path, pki, mutual=True)
    try:
        base = {"url": srv.url, "user": "learner", "password": pw["learner"], "tls_ca_file": str(pki.ca)}
        with pytest.raises(BusUnavailable):
            await connect_bus(BusConfig(**base, connect_budget_s=2.0), name="no-cert")  # type: ignore[arg-type]
        cert, key = pki.files["client"]
        bus = await connect_bus(
            BusConfig(**base, tls_cert_file=str(cert), tls_key_file=str(key)),  # type: ignore[arg-type]
            name="with-cert",
        )
        assert bus.connected
        await bus.close()
    finally:
        srv.stop()


def test_half_a_client_certificate_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="tls_cert_file and tls_key_file go together"):
        BusConfig(url="tls://127.0.0.1:1", tls_cert_file="/x.pem").tls_context()
