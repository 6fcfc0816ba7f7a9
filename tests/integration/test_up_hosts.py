"""`slipstream up --hosts 3`: the stack on three namespace hosts, a trajectory through it, and nothing left after.

The command runs as a user would run it (its own process); this test reads its stack.json, sends
an episode from outside the hosts (through the bridge) to the JetStream cluster, gets it back
scored and signed by the reward-model running on its host, then stops the command with SIGTERM
and checks that every namespace, veth and the bridge it made are gone. If the command dies or
the test fails, whatever it left is removed by name (the tag it printed).

Skipped, with the reason, where network namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from test_reward_model import read_scored, traj

from slipstream.bus import BusConfig, connect_bus
from slipstream.stack.hosts import unavailable
from slipstream.stack.stackfile import StackFile
from slipstream.trust import Check, Keyring, check_scored

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

WHY_NOT = unavailable()
if WHY_NOT:
    pytestmark.append(pytest.mark.skip(reason=f"no network namespaces: {WHY_NOT}"))


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False).stdout


def made(tag: str) -> tuple[list[str], list[str]]:
    """The namespaces and root-side links (veths, bridge) with this tag that exist now."""
    netns = sorted(n for n in _ip("netns", "list").split() if n.startswith(f"ss{tag}h"))
    links = [line.split(":")[1].strip().split("@")[0] for line in _ip("-o", "link", "show").splitlines()]
    return netns, sorted(n for n in links if n.startswith(f"ss{tag}") or n == f"ssbr{tag}")


def remove(tag: str) -> None:
    """What a killed command could leave: its namespaces, veths and bridge."""
    netns, links = made(tag)
    for link in links:
        _ip("link", "del", link)
    for n in netns:
        _ip("netns", "del", n)


def wait_state(path: Path, proc: subprocess.Popen[bytes], out: Path, timeout_s: float) -> StackFile:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"slipstream up exited {proc.returncode}:\n{out.read_text()[-3000:]}"
        if path.exists():
            state = msgspec.json.decode(path.read_bytes(), type=StackFile)
            if state.services and all(s.ready_after_s is not None for s in state.services.values()):
                return state
        time.sleep(0.5)
    raise AssertionError(f"not ready after {timeout_s:.0f} s:\n{out.read_text()[-3000:]}")


async def test_up_hosts_runs_the_stack_on_namespaces_a_trajectory_flows_and_stop_removes_them(tmp_path: Path) -> None:
    out = tmp_path / "up.out"
    argv = [sys.executable, "-m", "slipstream.cli", "up", "--hosts", "3", "--services", "reward-model"]
    argv += ["--run-dir", str(tmp_path / "run")]
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    with out.open("wb") as sink:
        proc = subprocess.Popen(argv, cwd=tmp_path, stdout=sink, stderr=subprocess.STDOUT, env=env)
    tag = ""
    try:
        state = wait_state(tmp_path / "run" / "stack.json", proc, out, 240)
        text = out.read_text()
        tags = set(re.findall(r"namespace ss([0-9a-f]{6})h\d", text))
        assert len(tags) == 1, text[-3000:]
        tag = tags.pop()
        netns, links = made(tag)
        assert netns == [f"ss{tag}h{i}" for i in range(3)] and len(links) == 4  # 3 veths + the bridge
        # The servers and the service listen on the hosts' addresses, not on this machine's loopback.
        nats_urls = state.servers["nats"].url.split(",")
        assert len(nats_urls) == 3
        assert state.servers["redis"].url.startswith("redis+sentinel://")
        rm = state.services["reward-model"].url
        address = ipaddress.ip_address(rm.split("//")[1].rsplit(":", 1)[0])
        assert address.is_private and not address.is_loopback
        deadline = time.monotonic() + 30  # stack.json is written just before the tables are printed
        while "where each process runs" not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert re.search(r"reward-model\W+1\W+ss" + tag + r"h1", out.read_text()), out.read_text()[-3000:]
        bus = await connect_bus(BusConfig(url=state.servers["nats"].url), name="test-outside")
        try:
            info = await bus.stream_info("TRAJ_SCORED")
            assert len(info["replicas"]) == 2 and info["leader"], info  # 3 copies
            t = traj("across-hosts", "8")
            await bus.publish("traj.raw.arith", t, msg_id=t.trajectory_id)
            scored = await read_scored(bus, 1, timeout_s=60)
        finally:
            await bus.close()
        assert [s.episode.episode_id for s in scored] == ["across-hosts"]
        assert scored[0].reward >= 1.0, scored[0]  # "8" is the reference: scored right
        keys = Keyring.parse(state.trust.score_trusted_keys)
        assert check_scored(scored[0], keys) is Check.OK, "not signed with the run's score key"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, out.read_text()[-3000:]
        assert made(tag) == ([], []), "stopping left namespaces or links behind"
        assert "removed the hosts" in out.read_text()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for left in [tag] if tag else set(re.findall(r"namespace ss([0-9a-f]{6})h\d", out.read_text())):
            remove(left)
