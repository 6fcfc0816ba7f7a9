"""Offline checks of the images: the Dockerfile's targets against the packages and the manifests.

Each service image installs exactly the libs its package depends on (and its code imports),
runs non-root, exposes the port and health check its deploy config gives it; CPU images take
torch from the CPU wheel index; every slipstream image a manifest names is a Dockerfile target.
"""

from __future__ import annotations

import ast
import re
import tomllib

import pytest
from deploy_helpers import DEPLOY, REPO, UID, images, pod_specs, render, table

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------- images


def test_build_script_lists_exactly_the_final_targets_and_they_run_non_root() -> None:
    stages = images.stages()
    finals = {n for n, s in stages.items() if s.entrypoint}
    assert set(images.build_targets()) == finals
    for name in finals:
        assert stages[name].user == f"{UID}:{UID}", name
        cuda = "CUDA_IMAGE" in images.root_base(stages, name)
        assert cuda == (name in {"rollout-worker", "learner", "learner-ray"}), name


@pytest.mark.parametrize("service", table.SERVICES)
def test_each_service_image_installs_exactly_its_libs_and_its_entry_point_exists(service: str) -> None:
    stages = images.stages()
    copied = images.copied_sources(stages, f"{service}-src")
    assert all((REPO / c).is_dir() for c in copied)
    assert copied == table.dependency_dirs(f"slipstream-{service}"), "libs copied != slipstream-* dependency closure"
    for target in (service, f"{service}-cpu"):
        if target in stages:
            assert stages[target].entrypoint == [table.console_script(service)], target
            assert (f"{service}-src", "/app/") in [(f, s) for f, s in stages[f"{target}-build"].copies]
    # The image's own health check asks /healthz on the port the deploy configs give the service.
    port = tomllib.loads(next((DEPLOY / "k8s/base").rglob(f"{service}.toml")).read_text())["service"]["http_port"]
    assert stages[service].expose[0] == port and f"http://127.0.0.1:{port}/healthz" in stages[service].healthcheck[-1]
    pyproject = tomllib.loads((REPO / "services" / service / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"][table.console_script(service)] == f"{table.package(service)}.__main__:main"
    main = table.source_dir(service) / "__main__.py"
    assert main.is_file(), f"{main} missing: the image's entry point has nothing to run"
    assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in ast.parse(main.read_text()).body)


def test_provision_image_entry_point_exists() -> None:
    stages = images.stages()
    assert stages["provision"].entrypoint == ["python", "-m", "slipstream.bus.provision"]
    # provision.py parses its config with slipstream.runtime.config, which slipstream-bus does not
    # declare: the image copies the runtime's closure too.
    wanted = table.dependency_dirs("slipstream-bus") | table.dependency_dirs("slipstream-runtime")
    assert images.copied_sources(stages, "provision-src") == wanted
    assert (REPO / "libs/bus/src/slipstream/bus/provision.py").is_file()


# Code that runs only with an optional extra the images do not install: libs/envs' `verifiers` extra
# (the engine and the endpoint, for envs/verifiers/, which also needs verifiers' own venv): its imports
# are the extra's, not the image's, and the registry imports it only when a run names `verifiers`.
EXTRA_ONLY = ("libs/envs/src/slipstream/envs/verifiers/",)


@pytest.mark.parametrize("stage", sorted(n for n in images.stages() if n.endswith("-src")))
def test_every_image_copies_the_libs_its_code_imports(stage: str) -> None:
    # The pyprojects can under-declare (provision.py above); what the code imports is what runs.
    where = images.package_dirs()
    copied = images.copied_sources(images.stages(), stage)
    missing = {
        f"{f.relative_to(REPO)} imports slipstream.{pkg}"
        for c in copied
        for f in (REPO / c / "src").rglob("*.py")
        if not str(f.relative_to(REPO)).startswith(EXTRA_ONLY)
        for pkg in images.runtime_imports(f.read_text())
        if pkg in where and where[pkg] not in copied
    }
    assert not missing, sorted(missing)
    assert images.runtime_imports("from slipstream.store import x\nif TYPE_CHECKING:\n    import slipstream.cli") == {
        "store"
    }


def test_cpu_images_take_torch_2_13_0_from_the_cpu_wheel_index() -> None:
    assert "torch==2.13.0" in (REPO / "tools/constraints.txt").read_text().split()
    text = images.DOCKERFILE.read_text()
    assert re.search(r"^ARG TORCH_CPU_INDEX=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    cpu_builder = text.split(" AS cpu-builder\n", 1)[1].split("\nFROM ", 1)[0]
    assert "PIP_EXTRA_INDEX_URL=${TORCH_CPU_INDEX}" in cpu_builder
    assert "-c /opt/slipstream/constraints.txt" in (DEPLOY / "docker/install-app.sh").read_text()
    stages = images.stages()
    torch_images = set()
    for target in images.build_targets():
        if "PYTHON_IMAGE" not in images.root_base(stages, target) or target == "provision":
            continue
        service = target.removesuffix("-cpu")
        pyprojects = [REPO / d / "pyproject.toml" for d in table.dependency_dirs(f"slipstream-{service}")]
        deps = [d for p in pyprojects for d in tomllib.loads(p.read_text())["project"].get("dependencies", [])]
        if any(re.match(r"torch\b", d) for d in deps):
            torch_images.add(target)
            assert images.builder(stages, f"{target}-build") == "cpu-builder", target
    # eval-gate runs the policy on its suite, so its CPU image carries torch.
    assert {"eval-gate", "rollout-worker-cpu", "learner-cpu", "weight-publisher"} <= torch_images
    assert "task-source" not in torch_images and "reward-model" not in torch_images


def test_dev_lets_tilt_sync_code_into_service_containers_and_prod_keeps_root_read_only() -> None:
    for overlay, writable in (("dev", True), ("prod", False)):
        checked = set()
        for owner, spec in pod_specs(render(overlay)):
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                if re.search(r"(^|/)slipstream/(?!provision)", c["image"]) and "--config" in c.get("args", []):
                    assert c["securityContext"]["readOnlyRootFilesystem"] is (not writable), f"{owner}/{c['name']}"
                    checked.add(c["name"])
        pool = {"subagent-pool"} if overlay == "prod" else set()  # the rollout-worker image as the sub-agent pool
        assert checked == set(table.SERVICES) | pool, (overlay, checked)


@pytest.mark.parametrize("overlay", ["dev", "prod", "prod/learner-ray"])
def test_every_slipstream_image_in_the_manifests_is_a_dockerfile_target(overlay: str) -> None:
    targets = set(images.build_targets())
    used = set()
    for _, spec in pod_specs(render(overlay)):
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            if m := re.search(r"(?:^|/)slipstream/([a-z-]+)", c["image"]):
                used.add(m[1])
    assert used and used <= targets, used - targets
