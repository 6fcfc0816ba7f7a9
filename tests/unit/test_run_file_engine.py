"""A run file's `[engine]` reaches the rollout workers' `EngineBackend` (type "vllm" and its settings),
and an unknown engine type, or a task screen on an engine out of process, is refused, naming its line,
when the file loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.run import RunFileError, load, service_env
from slipstream.runtime.config import resolve

pytestmark = pytest.mark.unit


def test_an_engine_table_configures_the_workers_vllm(tmp_path: Path) -> None:
    from slipstream.rollout_worker.config import RolloutWorkerConfig

    path = tmp_path / "vllm.toml"
    path.write_text(
        '[engine]\ntype = "vllm"\nvllm_python = "/opt/v/bin/python"\nvllm_kv_cache_gb = 2\n'
        'vllm_args = ["--seed", "3"]\nvllm_enforce_eager = false\n'
    )
    plan = load(path).plan()
    worker = resolve(RolloutWorkerConfig, environ=service_env(plan, Path("/m"), Path("/s"), Path("/o")))
    engine = worker.engine
    assert (engine.type, engine.vllm_python, engine.vllm_kv_cache_gb) == ("vllm", "/opt/v/bin/python", 2)
    assert engine.vllm_args == ["--seed", "3"] and engine.vllm_enforce_eager is False
    plain = tmp_path / "plain.toml"
    plain.write_text('name = "p"\n')
    assert resolve(RolloutWorkerConfig, environ=service_env(load(plain).plan(), *_paths())).engine.type == "torch"


def test_an_unknown_engine_type_is_refused_when_the_run_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[engine]\ntype = "sglang"\n')
    with pytest.raises(RunFileError, match=r"bad\.toml:2: engine\.type: Invalid enum value 'sglang'"):
        load(path)


@pytest.mark.parametrize("engine", ["vllm", "http"])
def test_a_task_screen_needs_the_torch_engine_and_is_refused_at_load(tmp_path: Path, engine: str) -> None:
    url = 'url = "http://127.0.0.1:1"\n' if engine == "http" else ""
    path = tmp_path / "screen.toml"
    path.write_text(f'[rollout]\nscreen_target = 0.8\n\n[engine]\ntype = "{engine}"\n{url}')
    with pytest.raises(RunFileError, match=rf"screen\.toml:2: \[rollout\] screen_target = 0\.8 needs .*'{engine}'"):
        load(path)
    path.write_text(f'[rollout]\nscreen_target = 0\n\n[engine]\ntype = "{engine}"\n{url}')
    assert load(path).plan().screen_target == 0
    path.write_text('[rollout]\nscreen_target = 0.8\n\n[engine]\ntype = "torch"\n')
    assert load(path).plan().screen_target == 0.8


def _paths() -> tuple[Path, Path, Path]:
    return Path("/m"), Path("/s"), Path("/o")
