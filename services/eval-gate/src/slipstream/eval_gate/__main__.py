"""Entry point of the eval-gate service: `python -m slipstream.eval_gate` or `slipstream-eval-gate`.

Config is parsed before the service module is imported, so `--help` is instant.
"""

from __future__ import annotations

import sys

from slipstream.eval_gate.config import EvalGateConfig
from slipstream.runtime import service_main


def main() -> int:
    return service_main("eval-gate", EvalGateConfig, "slipstream.eval_gate.service:EvalGateService")


if __name__ == "__main__":
    sys.exit(main())
