"""Entry point of the learner service: `python -m slipstream.learner` or `slipstream-learner`.

Config is parsed before the service module is imported, so `--help` is instant.
"""

from __future__ import annotations

import sys

from slipstream.learner.config import LearnerConfig
from slipstream.runtime import service_main


def main() -> int:
    return service_main("learner", LearnerConfig, "slipstream.learner.service:LearnerService")


if __name__ == "__main__":
    sys.exit(main())
