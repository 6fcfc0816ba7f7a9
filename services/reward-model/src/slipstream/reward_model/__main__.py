"""Entry point of the reward-model service: `python -m slipstream.reward_model` or `slipstream-reward-model`.

Config is parsed before the service module is imported, so `--help` is instant.
"""

from __future__ import annotations

import sys

from slipstream.reward_model.config import RewardModelConfig
from slipstream.runtime import service_main


def main() -> int:
    return service_main("reward-model", RewardModelConfig, "slipstream.reward_model.service:RewardModelService")


if __name__ == "__main__":
    sys.exit(main())
