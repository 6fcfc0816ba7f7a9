"""A supervisor killed with SIGKILL leaves no children behind (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slipstream.stack import pid_alive

pytestmark = pytest.mark.integration

SCRIPT = """
import sys, time
from pathlib import Path
from slipstream.stack import start_nats
d = Path(sys.argv[1])
srv = start_nats(d / "nats", d / "logs")
print(srv.pid, flush=True)
time.sleep(60)
"""


def test_children_die_when_the_supervisor_is_killed(tmp_path: Path) -> None:
    sup = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert sup.stdout is not None
    child = int(sup.stdout.readline())
    assert pid_alive(child)
    os.kill(sup.pid, signal.SIGKILL)
    sup.wait(timeout=10)
    sup.stdout.close()
    deadline = time.monotonic() + 10
    while pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(child), f"nats-server {child} outlived its SIGKILLed supervisor"
