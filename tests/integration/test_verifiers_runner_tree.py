"""Nothing started for a verifiers episode outlives the runner (libs/envs .../verifiers/reaper.py).

verifiers starts each `vf_lookup` episode's MCP tool server (`python -m vf_lookup`, under uv) in a
session of its own; a runner stopped with episodes in flight used to leave them running,
re-parented to init. Here real `vf_lookup` episodes run through the real runner and verifiers'
harness, held in flight by an engine that does not answer until told (a real ScriptedEngine
behind a gate), until their tool servers are up; then the runner is closed (what a stopping
worker does, `close_envs`), or the process that holds it is killed outright. Every process
started beneath the runner carries a marker in its environment (verifiers passes the runner's
environment on), so any that is left is found wherever it was re-parented.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from slipstream.engine import SamplingParams
from slipstream.engine.interface import GenerationRequest, GenerationResult
from slipstream.engine.tokenizer import ByteTokenizer
from slipstream.envs import get_env
from slipstream.envs.registry import close_envs
from slipstream.envs.verifiers.bridge import CLOSE_S, Bridge
from slipstream.harness.rollout import rollout_episodes
from slipstream.supervised.scripted import ScriptedEngine

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv-vf" / "bin" / "python"
TASKSETS = REPO / "examples" / "verifiers-envs"
TOK = ByteTokenizer()
MARK = "SLIPSTREAM_TEST_RUNNER_TREE"
EPISODES = 3

if not PYTHON.exists():
    pytest.skip(
        f"verifiers' venv {PYTHON} is not built (make verifiers-venv; CI skips: libs/envs README)",
        allow_module_level=True,
    )


def lookup_env(**options: Any) -> Any:
    return get_env(
        "verifiers",
        python=str(PYTHON),
        pythonpath=[str(TASKSETS)],
        env={"taskset": {"id": "vf_lookup"}, "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}},
        tasks=16,
        renderer={"tool_parser": "slipstream-tags"},
        **options,
    )


def marked(mark: str) -> dict[int, str]:
    """Live processes (not zombies) whose environment holds `MARK=mark`: pid -> command line."""
    found: dict[int, str] = {}
    needle = f"{MARK}={mark}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                continue
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def tool_servers(procs: dict[int, str]) -> list[int]:
    return [pid for pid, cmd in procs.items() if "vf_lookup" in cmd and "runner.py" not in cmd]


async def wait_for(what: str, check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g}s")
        await asyncio.sleep(0.2)


class Held:
    """A real engine whose calls wait until `gate` is set: episodes stay in flight meanwhile."""

    def __init__(self, inner: ScriptedEngine) -> None:
        self.inner = inner
        self.gate = asyncio.Event()
        self.waiting = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.waiting += 1
        await self.gate.wait()
        return await self.inner.generate(request)


def answer(request: Any, prompt: str) -> str:
    key = prompt.rsplit("What is stored under ", 1)[1].split("?", 1)[0]
    return '<tool_call>{"name": "lookup", "arguments": {"key": "' + key + '"}}</tool_call>'


async def start_held_episodes(engine: Held) -> tuple[asyncio.Task[Any], int]:
    """Episodes in flight, each waiting on its first sample with its tool server up; the runner's pid."""
    env = lookup_env()
    task = env.generate("train", 1, seed=0)[0]
    playing = asyncio.ensure_future(
        rollout_episodes(engine, TOK, env, task, group_size=EPISODES, params=SamplingParams(max_tokens=96))
    )
    await wait_for("episodes asking for their first sample", lambda: engine.waiting >= EPISODES, 600)
    mark = os.environ[MARK]
    await wait_for("a tool server per episode", lambda: len(tool_servers(marked(mark))) >= EPISODES, 60)
    (bridge,) = Bridge._open.values()
    assert bridge.runner.proc is not None
    return playing, bridge.runner.proc.pid


async def test_closing_the_runner_mid_episode_leaves_no_process_beneath_it(monkeypatch: pytest.MonkeyPatch) -> None:
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    engine = Held(ScriptedEngine(TOK, answer))
    await engine.start()
    try:
        playing, runner = await start_held_episodes(engine)
        before = marked(mark)
        assert runner in before and len(tool_servers(before)) == EPISODES, before
        # The tool servers sit in sessions of their own: the runner's group or session misses them.
        sessions = {os.getsid(pid) for pid in tool_servers(before)}
        assert os.getsid(runner) not in sessions and len(sessions) == EPISODES
        (bridge,) = Bridge._open.values()
        started = time.monotonic()
        await bridge.runner.close()  # the first thing a stopping worker's close_envs() does
        took = time.monotonic() - started
        left_at_exit = marked(mark)  # the runner is gone: so must be all it started
        await close_envs()  # and the rest of it: the route
        assert Bridge._open == {}
        with pytest.raises(RuntimeError, match="verifiers runner exited"):
            await playing
    finally:
        engine.gate.set()
        await Bridge.close_all()
        await engine.stop()
    assert left_at_exit == {}, f"left running when the runner exited: {left_at_exit}"
    assert marked(mark) == {}
    # Whether it ended on its own (cancel, verifiers' teardown, its reaper) or was killed by the
    # bridge after CLOSE_S depends on the machine's load (16.1 s once at load ~10), so it is only
    # reported; the runner's own reaping is what the next test shows, with no bridge to kill it.
    print(f"closing the runner took {took:.1f}s (the bridge kills it after {CLOSE_S:g}s)")


def test_a_killed_worker_leaves_no_process_beneath_its_runner(tmp_path: Path) -> None:
    """The process holding the bridge dies outright (SIGKILL): its runner sees its input close and
    gets SIGTERM (PR_SET_PDEATHSIG), and ends everything beneath it on its own."""
    mark = uuid.uuid4().hex
    ready = tmp_path / "ready"
    script = f"""
import asyncio, os, sys
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_verifiers_runner_tree import Held, ScriptedEngine, TOK, answer, start_held_episodes

async def main() -> None:
    engine = Held(ScriptedEngine(TOK, answer))
    await engine.start()
    _, runner = await start_held_episodes(engine)
    Path({str(ready)!r} + ".tmp").write_text(str(runner))
    os.replace({str(ready)!r} + ".tmp", {str(ready)!r})
    await asyncio.sleep(3600)

asyncio.run(main())
"""
    env = {**os.environ, MARK: mark}
    worker = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 700
        while not ready.exists():
            assert worker.poll() is None, f"the worker exited early ({worker.returncode})"
            assert time.monotonic() < deadline, "the worker never held its episodes in flight"
            time.sleep(0.2)
        before = marked(mark)
        assert int(ready.read_text()) in before and len(tool_servers(before)) == EPISODES, before
        worker.send_signal(signal.SIGKILL)
        worker.wait(30)
        deadline = time.monotonic() + 20
        while (left := marked(mark)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == {}, f"left running after the worker was killed: {left}"
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(30)


async def test_an_episode_its_asker_gave_up_on_leaves_no_process_while_the_runner_lives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cancelled episode (an evaluation that failed on another episode, say) is cancelled in the
    runner too: its harness and tool server go now, not when the runner closes. Before, an
    eval-gate retrying a failed evaluation left each try's servers running beneath the runner
    (51 of them, ~200 MB each, seen in one e2e run at load ~90)."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    engine = Held(ScriptedEngine(TOK, answer))
    await engine.start()
    try:
        playing, runner = await start_held_episodes(engine)
        assert len(tool_servers(marked(mark))) == EPISODES
        playing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await playing
        await wait_for("the cancelled episodes' tool servers gone", lambda: not tool_servers(marked(mark)), 30)
        (bridge,) = Bridge._open.values()
        assert bridge.runner.proc is not None and bridge.runner.proc.returncode is None  # the runner lives on
        assert runner in marked(mark)
    finally:
        engine.gate.set()
        await Bridge.close_all()
        await engine.stop()
    assert marked(mark) == {}


async def test_at_most_max_concurrent_episodes_run_in_the_runner_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """`max_concurrent` episodes are in the runner at once (their chat programs and tool servers
    up); the others wait outside it and run as those finish."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    engine = Held(ScriptedEngine(TOK, answer))
    await engine.start()
    env = lookup_env(max_concurrent=2)
    task = env.generate("train", 1, seed=0)[0]
    try:
        playing = asyncio.ensure_future(
            rollout_episodes(engine, TOK, env, task, group_size=EPISODES, params=SamplingParams(max_tokens=96))
        )
        await wait_for("two episodes asking for their first sample", lambda: engine.waiting >= 2, 600)
        await wait_for("their tool servers up", lambda: len(tool_servers(marked(mark))) >= 2, 60)
        await asyncio.sleep(5)  # room for a third to start, were it allowed to
        assert engine.waiting == 2 and len(tool_servers(marked(mark))) == 2
        engine.gate.set()
        episodes = await asyncio.wait_for(playing, 600)
        assert len(episodes) == EPISODES  # the third ran once a slot was free
    finally:
        engine.gate.set()
        await Bridge.close_all()
        await engine.stop()
