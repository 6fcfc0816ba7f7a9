"""Entry point of the rollout-worker service: `python -m slipstream.rollout_worker` or `slipstream-rollout-worker`.

Config is parsed before the service module is imported, so `--help` is instant.
"""

from __future__ import annotations

import sys

from slipstream.rollout_worker.config import RolloutWorkerConfig
from slipstream.runtime import service_main


def main() -> int:
    return service_main("rollout-worker", RolloutWorkerConfig, "slipstream.rollout_worker.service:RolloutWorkerService")


if __name__ == "__main__":
    sys.exit(main())
