"""Slipstream environments: the interface, the registry and the built-in verifiable tasks.

Importing the package registers the built-ins (`arith`, `reverse`), so `get_env(name)` finds them.
"""

# arith and strings register themselves on import; that import is what makes get_env find them.
from slipstream.envs.arith import Arith, ArithOptions
from slipstream.envs.base import (
    SPLITS,
    Environment,
    Episode,
    Message,
    Problem,
    Score,
    Split,
    StepResult,
    TaskSpec,
)
from slipstream.envs.registry import ENVIRONMENTS, EnvError, get_env, parse_options, register
from slipstream.envs.strings import Reverse, ReverseOptions

__all__ = [
    "ENVIRONMENTS",
    "SPLITS",
    "Arith",
    "ArithOptions",
    "EnvError",
    "Environment",
    "Episode",
    "Message",
    "Problem",
    "Reverse",
    "ReverseOptions",
    "Score",
    "Split",
    "StepResult",
    "TaskSpec",
    "get_env",
    "parse_options",
    "register",
]
