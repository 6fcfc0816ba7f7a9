"""`slipstream bench engine`'s vLLM backend, the parts that need no vLLM: its flags, when it runs or is
skipped (and what the JSON says then), and what it measures about processes (vllm_server.py)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slipstream.bench import engine as bench_engine
from slipstream.bench.vllm_server import NOT_ASKED, PYTHON_ENV, vllm_plan, vllm_section
from slipstream.engine.vllm_setup import group_rss_mb, terminate_group

pytestmark = pytest.mark.unit


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_engine.register(parser.add_subparsers())
    return parser.parse_args(["engine", *argv])


def test_vllm_is_opt_in_and_the_json_says_why_it_did_not_run() -> None:
    plan = vllm_plan(_args(), environ={PYTHON_ENV: sys.executable})
    assert not plan.runs and plan.skipped == NOT_ASKED
    section = vllm_section(plan, [])
    assert section["ran"] is False and section["skipped_because"] == NOT_ASKED and section["servers"] == []
    json.dumps(section)  # plain JSON


def test_asked_for_with_no_venv_it_is_skipped_naming_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "bin" / "python"
    plan = vllm_plan(_args("--vllm", "--vllm-python", str(missing)), environ={})
    assert not plan.runs
    assert str(missing) in plan.skipped and "make vllm-venv" in plan.skipped
    assert vllm_section(plan, [])["skipped_because"] == plan.skipped


def test_the_python_comes_from_the_flag_then_the_engine_variable_then_the_default(tmp_path: Path) -> None:
    flagged = tmp_path / "flag-python"
    flagged.write_text("")
    from_env = vllm_plan(_args("--vllm"), environ={PYTHON_ENV: sys.executable})
    assert from_env.runs and from_env.python == Path(sys.executable)
    from_flag = vllm_plan(_args("--vllm", "--vllm-python", str(flagged)), environ={PYTHON_ENV: sys.executable})
    assert from_flag.runs and from_flag.python == flagged
    default = vllm_plan(_args("--vllm"), environ={})
    assert default.python.parts[-3:] == (".venv-vllm", "bin", "python")
    assert not vllm_plan(_args("--vllm", "--no-generation"), environ={PYTHON_ENV: sys.executable}).runs


def test_threads_follow_torch_threads_unless_given_and_eager_unless_compiling() -> None:
    env = {PYTHON_ENV: sys.executable}
    assert vllm_plan(_args("--vllm", "--threads", "1"), environ=env).threads == 1
    assert vllm_plan(_args("--vllm"), environ=env).threads == 0  # every core, as --threads 0
    plan = vllm_plan(_args("--vllm", "--threads", "1", "--vllm-threads", "2", "--vllm-compile"), environ=env)
    assert (plan.threads, plan.enforce_eager, plan.kv_cache_gb) == (2, False, 1)
    section = vllm_section(plan, [{"dtype": "float32", "start_s": 31.0}])
    assert (section["ran"], section["skipped_because"], section["threads"], section["enforce_eager"]) == (
        True,
        None,
        2,
        False,
    )


@pytest.mark.parametrize(("flag", "value"), [("--vllm-threads", "-2"), ("--vllm-kv-cache-gb", "0")])
def test_bad_vllm_numbers_are_refused_naming_the_value(flag: str, value: str) -> None:
    with pytest.raises(SystemExit, match=f"{flag}.*{value}"):
        vllm_plan(_args("--vllm", flag, value), environ={})


def test_group_rss_counts_every_process_of_the_group_and_none_after_it_ends() -> None:
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30; wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while _names(members := _members(proc.pid)) != ["sh", "sleep", "sleep"] and time.monotonic() < deadline:
            time.sleep(0.02)  # until both children have exec'd sleep
        assert _names(members) == ["sh", "sleep", "sleep"], members
        want_kb = sum(_vm_rss_kb(pid) for pid in members)  # what `ps` shows, summed over the three
        assert group_rss_mb(proc.pid) == pytest.approx(want_kb * 1024 / 1e6, abs=0.2)
    finally:
        terminate_group(proc, grace_s=5.0)
    assert group_rss_mb(proc.pid) == 0.0


def _members(pgid: int) -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                out.append(pid)
        except (OSError, IndexError, ValueError):
            continue
    return out


def _names(pids: list[str]) -> list[str]:
    return sorted(Path(f"/proc/{pid}/comm").read_text().strip() for pid in pids)


def _vm_rss_kb(pid: str) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1])
