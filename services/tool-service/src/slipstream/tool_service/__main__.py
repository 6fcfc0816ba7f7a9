"""Entry point of the tool-service: `python -m slipstream.tool_service` or `slipstream-tool-service`.

Config is parsed before the service module is imported, so `--help` is instant.
"""

from __future__ import annotations

import sys

from slipstream.runtime import service_main
from slipstream.tool_service.config import ToolServiceConfig


def main() -> int:
    return service_main("tool-service", ToolServiceConfig, "slipstream.tool_service.service:ToolService")


if __name__ == "__main__":
    sys.exit(main())
