"""The bubblewrap sandbox against the real kernel: isolation, forks, limits, cleanup.

Every test runs real `bwrap` processes in fresh namespaces and cgroups (no double stands in for the
sandbox): what is asserted is what the kernel let the command do.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from slipstream.sandbox import BwrapProvider, Limits, SandboxError, cgroups

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(cgroups.available() is not None, reason=f"no cgroups here: {cgroups.available()}"),
]


@pytest.fixture
async def provider(tmp_path: Path) -> AsyncIterator[BwrapProvider]:
    p = BwrapProvider(tmp_path / "sandboxes", limits=Limits(wall_s=20))
    yield p
    await p.aclose()


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """A task tree: a module and its test, as a coding task's base layer."""
    root = tmp_path / "base"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("def add(a, b):\n    return a + b\n")
    (root / "test_mod.py").write_text("from pkg.mod import add\nassert add(2, 3) == 5\nprint('passed')\n")
    return root


async def test_runs_commands_over_the_base_and_writes_only_its_own_layer(provider: BwrapProvider, base: Path) -> None:
    box = await provider.create(base)
    result = await box.exec("python3 test_mod.py")
    assert (result.reason, result.stdout) == ("ok", "passed\n"), result
    await box.write("pkg/mod.py", "def add(a, b):\n    return a - b\n")
    broken = await box.exec("python3 test_mod.py")
    assert broken.reason == "exit" and broken.exit_code == 1 and "AssertionError" in broken.stderr
    assert (base / "pkg" / "mod.py").read_text() == "def add(a, b):\n    return a + b\n"  # the base is untouched
    assert await box.read("pkg/mod.py") == b"def add(a, b):\n    return a - b\n"
    with pytest.raises(FileNotFoundError, match=r"nope\.txt"):
        await box.read("nope.txt")


async def test_no_network_inside(provider: BwrapProvider) -> None:
    # A server on the host's loopback: a sandbox in its own network namespace cannot reach it.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    try:
        box = await provider.create()
        probe = (
            "import socket\n"
            f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 80)]:\n"
            "    s = socket.socket(); s.settimeout(2)\n"
            "    print(s.connect_ex(addr))\n"
            "print(sorted(n for _, n in socket.if_nameindex()))\n"
        )
        result = await box.exec(["python3", "-c", probe])
        refused, unreachable, interfaces = result.stdout.splitlines()
        assert int(refused) != 0 and int(unreachable) != 0, result
        assert interfaces == "['lo']"
    finally:
        server.close()


async def test_writes_outside_the_sandbox_are_impossible(provider: BwrapProvider, tmp_path: Path) -> None:
    marker = tmp_path / "host-marker"
    marker.write_text("host")
    box = await provider.create()
    result = await box.exec(
        f"echo x > /usr/evil; echo x > /etc/passwd; echo x > {marker}; ls {tmp_path}; "
        "ln -s /usr/lib escape && echo x > escape/evil; echo done"
    )
    assert result.stdout.strip() == "done"
    assert result.stderr.count("Read-only file system") >= 2, result.stderr
    assert marker.read_text() == "host" and not Path("/usr/evil").exists() and not Path("/usr/lib/evil").exists()
    with pytest.raises(PermissionError, match="only under /work"):
        await box.write("/etc/passwd", "x")


async def test_fork_edits_are_invisible_to_parent_and_siblings(provider: BwrapProvider, base: Path) -> None:
    parent = await provider.create(base)
    await parent.write("notes.txt", "parent-before\n")
    left, right = await parent.fork(), await parent.fork()
    await left.write("notes.txt", "left\n")
    await right.exec("rm notes.txt && echo right > only-right.txt")
    await parent.write("notes.txt", "parent-after\n")
    assert await left.read("notes.txt") == b"left\n"
    assert (await right.exec("ls")).stdout.split() == ["only-right.txt", "pkg", "test_mod.py"]
    assert await parent.read("notes.txt") == b"parent-after\n"
    assert (await parent.exec("test -e only-right.txt")).exit_code == 1
    # A grandchild sees its parent's state at the fork, not the edits after it.
    grandchild = await left.fork()
    await left.write("notes.txt", "left-later\n")
    assert await grandchild.read("notes.txt") == b"left\n"


async def test_frozen_layers_are_removed_once_nothing_holds_them(provider: BwrapProvider) -> None:
    parent = await provider.create()
    await parent.write("a", "1")
    child = await parent.fork()
    snap = await child.snapshot()
    assert provider.layer_count() == 2
    await parent.close()
    await child.close()
    assert provider.layer_count() == 2  # the snapshot still holds both
    provider.release(snap)
    assert provider.layer_count() == 0
    with pytest.raises(SandboxError, match="closed"):
        await parent.exec("true")


async def test_a_fork_bomb_ends_at_the_process_limit(provider: BwrapProvider) -> None:
    box = await provider.create()
    result = await box.exec("bomb() { bomb | bomb & }; bomb; sleep 1", limits=Limits(processes=16, wall_s=10))
    assert result.reason == "process_limit", result
    assert "process limit of 16 reached" in result.detail and "fork(s) refused" in result.detail


async def test_a_memory_hog_is_killed_at_the_memory_limit(provider: BwrapProvider) -> None:
    box = await provider.create()
    hog = "python3 -c 'blocks = [bytearray(2**20) for _ in range(1000)]; print(\"survived\")'"
    result = await box.exec(hog, limits=Limits(memory_mb=64))
    assert result.reason == "memory_limit", result
    assert result.detail == "memory limit of 64 MiB exceeded: the kernel killed the command"
    assert "survived" not in result.stdout


async def test_an_endless_loop_ends_at_the_cpu_limit(provider: BwrapProvider) -> None:
    box = await provider.create()
    result = await box.exec("python3 -c 'while True: pass'", limits=Limits(cpu_s=1, wall_s=30))
    assert result.reason == "cpu_limit", result
    assert result.exit_code == 128 + 24 and "CPU limit of 1 s" in result.detail


async def test_the_wall_clock_limit_kills_the_whole_tree(provider: BwrapProvider, tmp_path: Path) -> None:
    box = await provider.create()
    # A background child that would outlive a kill of the first process alone.
    # A duration no other test uses, so the /proc scan below finds only this tree's processes.
    result = await box.exec("(sleep 307 &) ; echo started; sleep 307", limits=Limits(wall_s=1))
    assert result.reason == "timeout" and result.exit_code == -1, result
    assert result.stdout == "started\n" and 1.0 <= result.wall_s < 10
    # The kill is sent before exec returns; on a busy machine the kernel may take a moment to reap.
    deadline = time.monotonic() + 5
    while sleeping := [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p) == "sleep 307"]:
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert sleeping == [], f"processes left running: {sleeping}"


async def test_file_size_and_output_limits(provider: BwrapProvider) -> None:
    box = await provider.create()
    big = await box.exec("head -c 3000000 /dev/zero > big", limits=Limits(file_size_mb=1))
    assert big.reason == "file_size_limit" and "file size limit of 1 MiB" in big.detail, big
    flood = await box.exec("yes | head -c 200000", limits=Limits(output_bytes=1000))
    assert flood.reason == "ok" and len(flood.stdout) == 1000 and flood.truncated


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


async def test_repeated_forks_keep_the_parents_chain(provider: BwrapProvider) -> None:
    parent = await provider.create()
    for i in range(3):
        await parent.write(f"f{i}", str(i))
        child = await parent.fork()
        assert (await child.exec("cat f*")).stdout == "".join(str(j) for j in range(i + 1))
        await child.close()
    assert (await parent.exec("cat f*")).stdout == "012"
    assert provider.layer_count() == 3
