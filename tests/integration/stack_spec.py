"""The whole local stack as the integration tests start it: every service, one shared staging folder."""

from __future__ import annotations

from pathlib import Path

from slipstream.stack.spec import StackSpec


def full_stack_spec(tmp: Path) -> StackSpec:
    """Every service on free ports under `tmp`; learner and publisher share a staging folder, as in a pod."""
    staging = str(tmp / "staging")
    return StackSpec(
        run_dir=tmp / "run",
        home=tmp / "home",
        drain_timeout_s=5.0,
        env={"SLIPSTREAM_LEARNER__STAGING_DIR": staging, "SLIPSTREAM_PUBLISHER__STAGING_DIR": staging},
    )
