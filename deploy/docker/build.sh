#!/usr/bin/env bash
# Build Slipstream images from deploy/docker/Dockerfile (what `make images` runs).
#
#   deploy/docker/build.sh                  # every target in TARGETS
#   deploy/docker/build.sh learner eval-gate
#   IMAGE_PREFIX=registry.example.com/slipstream TAG=0.1.0 PUSH=1 deploy/docker/build.sh
#
# Needs a Docker engine with BuildKit (Docker >= 23). CI and the project's dev machines have no
# Docker engine; there the images are checked offline by tests/unit/test_deploy_*.py instead.
set -euo pipefail

# Every final target of the Dockerfile (tests/unit/test_deploy_*.py checks this list against it).
TARGETS=(rollout-worker rollout-worker-cpu reward-model learner learner-cpu learner-ray weight-publisher eval-gate task-source tool-service provision)

IMAGE_PREFIX="${IMAGE_PREFIX:-slipstream}"
TAG="${TAG:-dev}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

if ! command -v docker >/dev/null 2>&1 || ! docker info >/dev/null 2>&1; then
    echo "build.sh: no running Docker engine found; images need one (the offline checks are in make test)" >&2
    exit 2
fi

if [ "$#" -gt 0 ]; then
    wanted=("$@")
else
    wanted=("${TARGETS[@]}")
fi

for target in "${wanted[@]}"; do
    known=0
    for t in "${TARGETS[@]}"; do [ "$t" = "$target" ] && known=1; done
    if [ "$known" -ne 1 ]; then
        echo "build.sh: unknown target '$target'; known: ${TARGETS[*]}" >&2
        exit 2
    fi
    image="${IMAGE_PREFIX}/${target}:${TAG}"
    echo "==> ${image}"
    DOCKER_BUILDKIT=1 docker build -f "${ROOT}/deploy/docker/Dockerfile" --target "${target}" -t "${image}" "${ROOT}"
    if [ "${PUSH:-0}" = "1" ]; then
        docker push "${image}"
    fi
done
