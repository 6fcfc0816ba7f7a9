"""Entry point of the weight-publisher service: `python -m slipstream.weight_publisher`, `slipstream-weight-publisher`.

Config is parsed before the service module is imported, so `--help` is instant.
"""

from __future__ import annotations

import sys

from slipstream.runtime import service_main
from slipstream.weight_publisher.config import WeightPublisherConfig


def main() -> int:
    return service_main(
        "weight-publisher", WeightPublisherConfig, "slipstream.weight_publisher.service:WeightPublisherService"
    )


if __name__ == "__main__":
    sys.exit(main())
