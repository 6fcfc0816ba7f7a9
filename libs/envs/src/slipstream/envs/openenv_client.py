"""`openenv`: an OpenEnv environment server played as a Slipstream environment.

    [env]
    name = "openenv"
    options = { base_url = "http://127.0.0.1:8001", action_field = "message", observation_field = "prompt" }

OpenEnv environments run as servers (openenv-core's FastAPI app: `reset`, `step`, `state`); a
client holds one WebSocket session per episode, since its HTTP `/reset` and `/step` build a fresh
environment per request and keep no episode. This environment is that client, through
openenv-core's own `GenericEnvClient`:

- a task is a reset seed: `generate(split, n, seed)` draws seeds, split by the base class's rule
  (one key in `heldout_one_in` held out), so a held-out seed never trains;
- `run(ctx)` resets the server's environment with the task's seed, shows the model the
  observation's `observation_field` text, sends each model output as the action
  `{action_field: text}` and shows the next observation's text (tokenised, mask 0), until the
  server says `done` or `max_turns` outputs were sent;
- the server's rewards, summed over the episode, are the reward component `env` (recorded during
  play, so the reward model need not reach the server); `correct` is a reward of at least
  `correct_at`.

The episode's tokens are the harness's own (ctx.open / generate / observe), so what trains is
exactly what the model sampled. openenv-core is imported only when this environment is named (it
is registered through libs/envs' entry point; install libs/envs' `openenv` extra).
"""

from __future__ import annotations

import random
from typing import Annotated, Any, ClassVar

import msgspec
from openenv.core.generic_client import GenericEnvClient  # type: ignore[import-untyped]  # ships no type information

from slipstream.envs.base import Environment, Problem, Score, TaskSpec, play_rewards
from slipstream.envs.context import EpisodeContext, Outcome
from slipstream.envs.registry import register
from slipstream.schemas import Episode

Doc = msgspec.Meta

REWARD = "env"


class OpenEnvOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Options of `openenv`: where the server is and how its actions and observations carry text."""

    base_url: Annotated[str, Doc(description="The OpenEnv server, http://host:port (its /ws is used).")] = (
        "http://127.0.0.1:8000"
    )
    action_field: Annotated[str, Doc(description="The action's field that carries the model's text.")] = "message"
    observation_field: Annotated[str, Doc(description="The observation's field shown to the model.")] = "prompt"
    seeds: Annotated[int, Doc(description="Distinct reset seeds tasks are drawn from.")] = 1_000_000
    max_turns: Annotated[int, Doc(description="Most model outputs per episode.")] = 4
    max_answer_chars: Annotated[int, Doc(description="Longest single output (decoding bound).")] = 64
    correct_at: Annotated[float, Doc(description="An episode reward at least this counts as correct.")] = 1.0
    timeout_s: Annotated[float, Doc(description="Seconds to wait for the server's answer to one message.")] = 30.0

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ValueError(f"base_url must be an http(s):// or ws(s):// URL, got {self.base_url!r}")
        if not self.action_field or not self.observation_field:
            raise ValueError("action_field and observation_field must be non-empty")
        if self.seeds < 1 or self.max_turns < 1 or self.max_answer_chars < 1 or self.timeout_s <= 0:
            raise ValueError(
                f"need seeds, max_turns, max_answer_chars >= 1 and timeout_s > 0, got {self.seeds}, "
                f"{self.max_turns}, {self.max_answer_chars}, {self.timeout_s}"
            )


def observation_text(observation: dict[str, Any], field: str) -> str:
    """The text an observation shows the model; a missing or non-text field is the server's error."""
    value = observation.get(field)
    if not isinstance(value, str):
        raise ValueError(f"the OpenEnv observation has no text field {field!r} (fields: {sorted(observation)})")
    return value


@register("openenv")
class OpenEnv(Environment[OpenEnvOptions]):
    """An OpenEnv server's environment, one WebSocket session per episode (see the module docstring)."""

    Options = OpenEnvOptions
    version: ClassVar[str] = "1"
    components: ClassVar[tuple[str, ...]] = (REWARD,)
    terminator: ClassVar[str] = "\n"
    max_turns: ClassVar[int] = 64  # the per-instance bound is `options.max_turns`

    @property
    def max_completion_chars(self) -> int:
        return self.options.max_answer_chars

    def sample(self, rng: random.Random) -> Problem:
        seed = rng.randrange(self.options.seeds)
        # The prompt is the server's, known only after reset; the task carries the seed.
        return Problem(key=f"seed-{seed}", prompt="", reference="")

    def _seed(self, task: TaskSpec) -> int:
        key = str(task.metadata.get("key", ""))
        if not key.startswith("seed-"):
            raise ValueError(f"task {task.task_id!r} carries no reset seed (metadata key {key!r})")
        return int(key.removeprefix("seed-"))

    async def run(self, ctx: EpisodeContext) -> Outcome:
        opts = self.options
        total = 0.0
        finish = "max_turns"
        async with GenericEnvClient(base_url=opts.base_url, message_timeout_s=opts.timeout_s) as server:
            result = await server.reset(seed=self._seed(ctx.task))
            thread = ctx.open(observation_text(result.observation, opts.observation_field))
            for turn in range(opts.max_turns):
                generation = await ctx.generate(thread)
                action = generation.text.split(self.terminator, 1)[0].strip()
                result = await server.step({opts.action_field: action})
                total += float(result.reward or 0.0)
                ctx.count("env_steps")
                if result.done:
                    finish = generation.finish_reason
                    break
                if turn + 1 < opts.max_turns:
                    ctx.observe(thread, observation_text(result.observation, opts.observation_field))
        ctx.reward(REWARD, total)
        return Outcome(final_text=thread.completion_text(), finish_reason=finish)

    def grade_episode(self, task: TaskSpec, episode: Episode) -> Score:
        """The server's reward was recorded during play (`reward.env`); this adds nothing to it."""
        played = play_rewards(episode)
        if REWARD not in played:
            return self.failure(f"episode {episode.episode_id!r} has no reward recorded from the OpenEnv server")
        correct = played[REWARD] >= self.options.correct_at
        return Score.of({}, correct=correct, parse_ok=True, reason=f"server reward {played[REWARD]:g}")

    def grade(self, task: TaskSpec, completion: str) -> Score:
        return self.failure("an OpenEnv episode's reward comes from its server; a completion text alone has none")
