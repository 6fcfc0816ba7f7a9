"""Runs as data: the run file, the training plan it resolves to, and the services' config from it."""

from slipstream.run.plan import RunSummary, TrainingPlan, run_env, service_env, service_overrides
from slipstream.run.runfile import RunFile, RunFileError, env_file, load, parse_env_file

__all__ = [
    "RunFile",
    "RunFileError",
    "RunSummary",
    "TrainingPlan",
    "env_file",
    "load",
    "parse_env_file",
    "run_env",
    "service_env",
    "service_overrides",
]
