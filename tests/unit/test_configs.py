"""Every config file in the repo parses into its service's config class.

`services/<svc>/configs/*.toml` and every `deploy/**/<service-name>.toml` (the files the
manifests mount) are resolved exactly as the service would resolve them at start, with no
environment layered on top; any unknown key or bad value fails here, not in a pod.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import msgspec
import pytest

from slipstream.runtime.config import resolve

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
CONFIG_CLASSES = {
    "rollout-worker": "slipstream.rollout_worker.config:RolloutWorkerConfig",
    "reward-model": "slipstream.reward_model.config:RewardModelConfig",
    "learner": "slipstream.learner.config:LearnerConfig",
    "weight-publisher": "slipstream.weight_publisher.config:WeightPublisherConfig",
    "eval-gate": "slipstream.eval_gate.config:EvalGateConfig",
    "task-source": "slipstream.task_source.config:TaskSourceConfig",
    "tool-service": "slipstream.tool_service.config:ToolServiceConfig",
}


def config_class(service: str) -> type[msgspec.Struct]:
    module, _, name = CONFIG_CLASSES[service].partition(":")
    cls: type[msgspec.Struct] = getattr(importlib.import_module(module), name)
    return cls


def service_files() -> list[tuple[str, Path]]:
    return [(svc, p) for svc in CONFIG_CLASSES for p in sorted((REPO / "services" / svc / "configs").glob("*.toml"))]


def deploy_files() -> list[tuple[str, Path]]:
    return [(p.stem, p) for p in sorted((REPO / "deploy").rglob("*.toml")) if p.stem in CONFIG_CLASSES]


def test_every_service_dir_is_known_and_has_an_example_config() -> None:
    assert sorted(p.name for p in (REPO / "services").iterdir() if p.is_dir()) == sorted(CONFIG_CLASSES)
    assert sorted({svc for svc, _ in service_files()}) == sorted(CONFIG_CLASSES)


@pytest.mark.parametrize(("service", "path"), service_files(), ids=lambda v: str(v).rsplit("/services/", 1)[-1])
def test_service_config_files_parse(service: str, path: Path) -> None:
    cfg = resolve(config_class(service), config_file=path, environ={})
    assert isinstance(cfg, config_class(service))


@pytest.mark.parametrize(("service", "path"), deploy_files(), ids=lambda v: str(v).rsplit("/deploy/", 1)[-1])
def test_deploy_config_files_parse(service: str, path: Path) -> None:
    cfg = resolve(config_class(service), config_file=path, environ={})
    assert isinstance(cfg, config_class(service))


def test_a_bad_key_in_a_config_file_fails(tmp_path: Path) -> None:
    # The same path the tests above take, shown to reject what it must.
    from slipstream.runtime.config import ConfigError

    bad = tmp_path / "learner.toml"
    bad.write_text("[bus]\nurll = 'nats://x:4222'\n")
    with pytest.raises(ConfigError, match=r"unknown key bus\.urll"):
        resolve(config_class("learner"), config_file=bad, environ={})
