"""The run's environments, checked when a run file or the demo's flags load: before anything starts.

A wrong environment name, a plugin that fails to import, or an option the environment does not
take (or rejects) would otherwise surface seconds later, as a traceback from the warm-start or a
service that dies at setup. These ask the environment registry (libs/envs) exactly what every
service will ask it, `parse_options(name, options)`, so the message is the registry's: the bad
value, and the environments or options that exist. Options are parsed, not built: building an
environment can be costly (a generated corpus, a sandbox pool), parsing is not.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def check_env(name: str, options: Mapping[str, Any] | None = None) -> None:
    """Raise `EnvError` (a ValueError) naming what is wrong with environment `name` or its `options`.
    Without `options` only the name is checked: an environment whose defaults are not runnable
    (`verifiers` needs its taskset named) is not refused for options nobody gave yet."""
    # Imported here, so `import slipstream.run` stays light for what only renders config.
    from slipstream.envs.registry import environment_class, parse_options

    if options is None:
        environment_class(name)
    else:
        parse_options(name, options)


def check_suites(suites: Iterable[str]) -> None:
    """Raise `EnvError` naming the first eval suite that is not an environment (or fails to load)."""
    from slipstream.envs.registry import EnvError

    for suite in suites:
        try:
            check_env(suite, {})  # a suite runs on its defaults: they must parse
        except EnvError as exc:
            raise EnvError(f"eval suite {suite!r}: {exc}") from None


def check_plan(env: str, options: Mapping[str, Any], suites: Iterable[str] = ()) -> None:
    """`check_env` then `check_suites`: a plan built from flags (`slipstream demo --env ...`)."""
    check_env(env, options)
    check_suites(suites)
