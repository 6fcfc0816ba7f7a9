"""The work: turn one task into its group of episodes with the engine and the env harness.

Before sampling, a task waits until the engine holds at least its `min_policy_version` (the task
source sets it to bound staleness at the source; with max_staleness 0 this is what makes the
synchronous baseline sample with fresh weights). Environments are built once per name, with the
options from `[worker] env_options`; sampling parameters come from `[worker]`, plus the env's
answer terminator as a stop string; `[summary]` restarts long contexts (summary.py in libs/harness).
Tool calls run in-process, or in the tool-service when
`[tools] transport = "nats"` (the factory the service passes in). Frozen sub-agents run on the
frozen engine (`[subagents] transport = "local"`) or in the pinned pool (`"nats"`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from slipstream.engine.interface import Engine, SamplingParams
from slipstream.engine.tokenizer import Tokenizer
from slipstream.envs import EnvError, Environment, get_env
from slipstream.harness import TaskRejected, rollout_episodes
from slipstream.harness.subagents import SubagentTransport
from slipstream.harness.summary import SummaryConfig
from slipstream.rollout_worker.config import WorkerSection
from slipstream.rollout_worker.instruments import ROLLOUT_S
from slipstream.schemas import Episode, Task
from slipstream.toolcalls import ToolRegistry, ToolTransport

ToolsFactory = Callable[[ToolRegistry], ToolTransport]

_VERSION_POLL_S = 0.02


class Sampler:
    """Environment lookup, sampling parameters, the version gate and the group rollout."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        cfg: WorkerSection,
        *,
        worker_id: str,
        run_id: str,
        tools: ToolsFactory | None = None,
        summary: SummaryConfig | None = None,
        frozen_engine: Engine | None = None,
        subagents: SubagentTransport | None = None,
    ) -> None:
        self.engine = engine
        self.frozen_engine = frozen_engine
        self.subagents = subagents
        self.summary = summary if summary is not None and summary.enabled else None
        self.tools = tools
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.worker_id = worker_id
        self.run_id = run_id
        self._envs: dict[str, Environment[Any]] = {}
        self._params: dict[str, SamplingParams] = {}

    def env(self, name: str) -> Environment[Any]:
        """The environment `name` with its configured options; TaskRejected if it is unknown."""
        env = self._envs.get(name)
        if env is None:
            try:
                env = get_env(name, **self.cfg.env_options.get(name, {}))
            except EnvError as exc:
                raise TaskRejected(str(exc)) from exc
            self._envs[name] = env
        return env

    def params(self, env: Environment[Any]) -> SamplingParams:
        params = self._params.get(env.name)
        if params is None:
            stop = list(self.cfg.stop)
            if self.cfg.stop_at_terminator and env.terminator and env.terminator not in stop:
                stop.append(env.terminator)
            params = SamplingParams(
                temperature=self.cfg.temperature,
                top_p=self.cfg.top_p,
                top_k=self.cfg.top_k,
                max_tokens=self.cfg.max_tokens,
                stop=stop,
                ignore_eos=self.cfg.ignore_eos,
            )
            self._params[env.name] = params
        return params

    async def wait_for_version(self, version: int, timeout_s: float) -> bool:
        """Wait until the engine samples with at least `version`; False after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.engine.policy_version < version:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_VERSION_POLL_S)
        return True

    async def sample(self, task: Task) -> list[Episode]:
        """The task's group: `task.group_size` episodes under a fresh group id."""
        env = self.env(task.env)
        t0 = time.perf_counter()
        episodes = await rollout_episodes(
            self.engine,
            self.tokenizer,
            env,
            task,
            group_size=task.group_size,
            params=self.params(env),
            worker_id=self.worker_id,
            run_id=task.run_id or self.run_id,
            tools=self.tools,
            summary=self.summary,
            frozen_engine=self.frozen_engine,
            subagents=self.subagents,
            purpose="train",  # what training-only help (the search env's soft budget message) keys on
        )
        ROLLOUT_S.observe(time.perf_counter() - t0)
        return episodes


def check_env_options(options: dict[str, dict[str, Any]]) -> None:
    """Build every configured environment once, so a bad option fails at start, naming it."""
    for name, opts in options.items():
        if not isinstance(opts, dict):
            raise EnvError(f"[worker] env_options.{name} must be a table, got {type(opts).__name__}")
        get_env(name, **opts)


def check_summary(summary: SummaryConfig, max_seq_len: int, max_tokens: int) -> None:
    """A `[summary]` that cannot work with `[worker]` fails at start: its largest threshold plus a
    summary must fit `max_seq_len`, and a summary's budget must fit one turn's `max_tokens` (a
    turn is capped by it)."""
    if summary.enabled and (summary.mode == "summary" or summary.policy) and summary.summary_tokens > max_tokens:
        raise ValueError(
            f"summary.summary_tokens {summary.summary_tokens} is more than worker.max_tokens {max_tokens}, "
            "which caps every turn, a summary included"
        )
    need = summary.max_tokens + summary.summary_tokens + 64
    if summary.enabled and max_seq_len and need > max_seq_len:
        raise ValueError(
            f"summary.max_tokens {summary.max_tokens} + summary.summary_tokens {summary.summary_tokens} (+ 64 for "
            f"the request) = {need} does not fit worker.max_seq_len {max_seq_len}"
        )
