"""A 2-rank learner on a Ray cluster spread over two namespace hosts, and the loss of the worker host.

`raycluster.start_ray_cluster` puts a Ray head on host 0 and a worker node on host 1 (each `ray
start` inside its namespace, on its host's address); the learner's `RankGroup` joins it with
`ray_address` and `rank_resource`, so rank r runs on node r. The driver runs on host 0 (a Ray
driver needs a raylet on its own node), as ray_hosts_driver.py. This test drives the learner's own
step entry point (`RankGroup.step`, what the learner service calls each step) on the learner's
synthetic arith trajectories, not the whole stack, to keep Ray on 2 shared cores to one cluster:

1. the ranks report the two hosts' addresses; after 2 steps every rank gathers the same policy
   (equal digests, changed by the steps), and it is the policy one process trains on the same data;
2. the worker host's Ray node is killed (every process of it, the rank actor with it) while the
   ranks step: the step fails with a `RankError` naming the lost rank, within seconds;
3. the node is started again on its host; a new group places its ranks on both hosts again, loads
   the checkpoint the ranks wrote before the kill (same digests) and steps on.

Every namespace, veth, Ray process and the cluster's session directory are gone afterwards.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from ray_hosts_driver import LOSS, SOURCE, section, steps_data

from slipstream.learner.group import SingleRank, open_ranks
from slipstream.stack.hosts import Host, Hosts, unavailable
from slipstream.stack.process import pid_alive
from slipstream.stack.raycluster import RANK_RESOURCE, RayCluster, ray_unavailable, start_ray_cluster

WHY = unavailable() or ray_unavailable()
pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(bool(WHY), reason=f"a Ray cluster on namespace hosts cannot run here: {WHY}"),
    pytest.mark.timeout(900),
]

DRIVER = Path(__file__).with_name("ray_hosts_driver.py")
STEPS = 2
EVENT_TIMEOUT_S = 300.0  # Ray, the model and two ranks start in 20-120 s on 2 loaded cores
FAIL_WITHIN_S = 45.0
"""The lost node's rank dies with its sockets: the step fails long before `rank_timeout_s` (30 s) plus slack."""


class Driver:
    """ray_hosts_driver.py on `host`: its events read as they come, its commands written to its stdin."""

    def __init__(self, host: Host, address: str, env: dict[str, str], out: Path) -> None:
        argv = [sys.executable, str(DRIVER), "--address", address, "--resource", RANK_RESOURCE]
        argv += ["--out", str(out), "--steps", str(STEPS)]
        self.stderr = (out / "driver.stderr").open("wb")
        self.proc = subprocess.Popen(
            host.exec_argv(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            start_new_session=True,
            text=True,
            env={**os.environ, **env},
        )
        self.out = out
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.put(json.loads(line))
        self.events.put({"event": "exit"})

    def expect(self, name: str, timeout_s: float = EVENT_TIMEOUT_S) -> dict[str, Any]:
        """The next event, which must be `name`."""
        try:
            ev = self.events.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"no {name!r} from the driver within {timeout_s} s:\n{self.tail()}") from None
        assert ev["event"] == name, f"expected {name!r}, the driver said {ev}:\n{self.tail()}"
        return ev

    def send(self, word: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def tail(self) -> str:
        self.stderr.flush()
        return "\n".join((self.out / "driver.stderr").read_text(errors="replace").splitlines()[-30:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        self.stderr.close()


def trained_in_one_process() -> dict[str, torch.Tensor]:
    """The same steps on the same data, in this process without Ray: what the ranks must end with."""
    torch.set_num_threads(1)
    single = open_ranks(SOURCE, msgspec.structs.replace(section("", "", ""), ranks=1), LOSS)
    assert isinstance(single, SingleRank)
    for s, groups in enumerate(steps_data(STEPS)):
        assert single.step(groups, s, step=s).applied
    return {k: v.detach().clone() for k, v in single.model.state_dict().items()}


def test_two_ranks_on_two_hosts_and_the_worker_host_lost(tmp_path: Path) -> None:
    seen: list[int] = []
    cluster: RayCluster | None = None
    with Hosts(2) as hosts:
        head, worker = hosts[0], hosts[1]
        driver: Driver | None = None
        try:
            t0 = time.monotonic()
            cluster = start_ray_cluster(hosts, 2, tmp_path / "logs")
            started_s = time.monotonic() - t0
            seen += cluster.pids(0) + cluster.pids(1)
            driver = Driver(head, cluster.address, cluster.client_env, tmp_path)

            # 1. placement and two steps
            ev = driver.expect("placed")
            assert ev["nodes"] == [head.address, worker.address], f"ranks not on the two hosts: {ev}"
            assert len(set(ev["pids"])) == 2
            for s in range(STEPS):
                st = driver.expect("stepped")
                assert st["step"] == s and st["applied"] and all(st["rows"]), f"step {s}: {st}"
            ev = driver.expect("trained")
            assert ev["after"][0] == ev["after"][1], f"the ranks hold different policies after the steps: {ev}"
            assert ev["before"][0] == ev["before"][1] and ev["after"][0] != ev["before"][0], ev
            saved = driver.expect("saved")["digests"]
            ranks_state = torch.load(tmp_path / "ranks.pt")
            single = trained_in_one_process()
            assert set(ranks_state) == set(single)
            for name, value in single.items():
                diff = float((ranks_state[name].float() - value.float()).abs().max())
                assert diff <= 2e-5, f"{name}: the ranks across hosts differ from one process by {diff}"
            seen += cluster.pids(0) + cluster.pids(1)

            # 2. the worker host's Ray node is lost mid-training
            driver.send("go")
            driver.expect("stepped")  # training is under way
            killed = cluster.kill(1)
            kill_at = time.time()
            assert killed and not any(pid_alive(p) for p in killed)
            ev = driver.expect("failed", FAIL_WITHIN_S + 30)
            failed_error = ev["error"]
            # Whichever rank's call ends first (rank 1's actor died, or rank 0's collective lost its peer),
            # the error names rank 1 and the worker host's address.
            assert "rank 1" in failed_error and worker.address in failed_error, ev
            failed_after_s = ev["failed_at"] - kill_at
            assert failed_after_s < FAIL_WITHIN_S, f"the step failed {failed_after_s:.1f} s after the kill"
            driver.expect("closed", 60)

            # 3. the node back on its host: new ranks on both hosts, from the checkpoint
            t1 = time.monotonic()
            cluster.start(1)
            seen += cluster.pids(1)
            driver.send("restart")
            ev = driver.expect("placed")
            assert ev["nodes"] == [head.address, worker.address], ev
            assert driver.expect("resumed")["digests"] == saved
            ev = driver.expect("recovered")
            recovered_s = time.monotonic() - t1
            assert ev["applied"] and ev["digests"][0] == ev["digests"][1] != saved[0], ev
            driver.expect("exit", 60)
            assert driver.proc.wait(10) == 0, driver.tail()
            print(
                json.dumps(
                    {
                        "cluster_started_s": round(started_s, 1),
                        "step_failed_after_kill_s": round(failed_after_s, 2),
                        "error": failed_error,
                        "restart_to_step_s": round(recovered_s, 1),
                    }
                )
            )
        finally:
            if driver is not None:
                driver.stop()
            if cluster is not None:
                cluster.stop()
    assert hosts.names() == [] and hosts.links() == []
    assert cluster is not None and not cluster.temp_dir.exists()
    left = [p for p in set(seen) if pid_alive(p)]
    assert not left, f"Ray processes outlived the hosts: {left}"
