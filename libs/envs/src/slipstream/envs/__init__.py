"""Slipstream environments: the interface, the registry and the built-in verifiable tasks.

Importing the package registers the built-ins (`arith`, `chatty`, `reverse`, `search_call`, `lookup`, `search`,
`recall`, `serve`, `swarm`), so `get_env(name)` finds them.
"""

# The env modules register themselves on import; that import is what makes get_env find them.
from slipstream.envs.arith import Arith, ArithOptions
from slipstream.envs.base import (
    PLAY_REWARD_PREFIX,
    SPLITS,
    Environment,
    Message,
    Problem,
    Score,
    Split,
    StepResult,
    TaskSpec,
    Transcript,
    play_rewards,
    task_of,
)
from slipstream.envs.chatty import Chatty, ChattyOptions
from slipstream.envs.code import Code, CodeOptions
from slipstream.envs.context import ContextFull, EpisodeContext, Generation, Outcome, Span, Thread
from slipstream.envs.lookup import Lookup, LookupOptions
from slipstream.envs.recall import Recall, RecallOptions
from slipstream.envs.registry import ENVIRONMENTS, EnvError, get_env, parse_options, register, task_envs
from slipstream.envs.search import Search, SearchOptions
from slipstream.envs.searchcall import SearchCall, SearchCallOptions
from slipstream.envs.serve import RewardComponent, Serve, ServeOptions
from slipstream.envs.strings import Reverse, ReverseOptions
from slipstream.envs.swarm import Swarm, SwarmOptions

__all__ = [
    "ENVIRONMENTS",
    "PLAY_REWARD_PREFIX",
    "SPLITS",
    "Arith",
    "ArithOptions",
    "Chatty",
    "ChattyOptions",
    "Code",
    "CodeOptions",
    "ContextFull",
    "EnvError",
    "Environment",
    "EpisodeContext",
    "Generation",
    "Lookup",
    "LookupOptions",
    "Message",
    "Outcome",
    "Problem",
    "Recall",
    "RecallOptions",
    "Reverse",
    "ReverseOptions",
    "RewardComponent",
    "Score",
    "Search",
    "SearchCall",
    "SearchCallOptions",
    "SearchOptions",
    "Serve",
    "ServeOptions",
    "Span",
    "Split",
    "StepResult",
    "Swarm",
    "SwarmOptions",
    "TaskSpec",
    "Thread",
    "Transcript",
    "get_env",
    "parse_options",
    "play_rewards",
    "register",
    "task_envs",
    "task_of",
]
