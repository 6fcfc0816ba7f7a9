"""Render a Kustomize directory with the real kustomize that kubectl carries (`kubectl kustomize DIR`).

kubectl (v1.32, kustomize v5.5) is installed on the development and CI machines, so the deploy
tests, `pod_config.py` and the Tiltfile check exactly what `kubectl apply -k` would send. This
module only runs it and parses its YAML stream; a failure comes back as `KustomizeError` with
kustomize's own message and the directory it was rendering.

Usage: python deploy/tools/kustomize.py deploy/k8s/overlays/dev   (prints the YAML stream)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

TIMEOUT_S = 60


class KustomizeError(RuntimeError):
    """kubectl is missing, or kustomize refused the directory (its message is kept)."""


def render_text(path: str | Path) -> str:
    """The YAML stream `kubectl kustomize path` prints."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise KustomizeError("kubectl is not on PATH: install kubectl (its built-in kustomize renders deploy/)")
    proc = subprocess.run(
        [kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    if proc.returncode != 0:
        raise KustomizeError(f"kubectl kustomize {path}: {proc.stderr.strip() or f'exit {proc.returncode}'}")
    return proc.stdout


def build(path: str | Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize path` renders, in its order."""
    return [doc for doc in yaml.safe_load_all(render_text(path)) if doc]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: kustomize.py DIR", file=sys.stderr)
        return 2
    try:
        sys.stdout.write(render_text(argv[0]))
    except KustomizeError as exc:
        print(f"kustomize: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
