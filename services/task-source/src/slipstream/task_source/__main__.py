"""Entry point of the task source: `python -m slipstream.task_source` or `slipstream-task-source`.

Config is parsed before the service module is imported, so `--help` is instant.
"""

from __future__ import annotations

import sys

from slipstream.runtime import service_main
from slipstream.task_source.config import TaskSourceConfig


def main() -> int:
    return service_main("task-source", TaskSourceConfig, "slipstream.task_source.service:TaskSourceService")


if __name__ == "__main__":
    sys.exit(main())
