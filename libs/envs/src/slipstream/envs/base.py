"""The environment interface: task specs, episodes, steps and scores.

An environment is what a rollout plays against and what judges its outcome. The same object runs
in the rollout worker (`generate`, `reset`, `step`), in the reward model (`score`) and in the eval
gate (the held-out split), so a policy is trained in the harness it is deployed in.

Step contract, the same for single- and multi-turn environments:

- `reset(task)` opens a `Transcript` (the episode's text so far); its first observation is the
  task's prompt.
- The worker generates a model output and calls `step(episode, output)`. The policy's tokens are
  exactly the model outputs: they carry loss mask 1 and the policy version that sampled them.
- A step that returns an observation (a tool result, a token-budget line) asks the worker to
  append that text's tokens to the sequence with loss mask 0 (context, never trained; a `Turn`
  with role "observation" in the trajectory) and to generate again.
- `done=True` ends the episode. Single-turn environments are done after one step and return no
  observation. `max_turns` bounds every episode; a step past it ends the episode with
  `info["truncated"] = "max_turns"`.
- `score(task, episode)` judges an outcome with named components that sum to the reward; it
  receives the whole wire `Episode` (samples, tool log, counts, final text), or, as before, just
  the completion text. It never raises: a broken or unparsable completion is a failure score
  (reward 0.0, every component 0.0, `parse_ok=False`) whose `reason` says why.

The episode-level interface underneath: `run(ctx)` plays a whole episode through an
`EpisodeContext` (context.py) — generate, observe, call tools, branch the context, spawn nested
agents — and returns an `Outcome`. The default `run` is the adapter that drives `reset`/`step`
above, so an environment written against them runs unchanged; an agentic environment overrides
`run` (and `grade_episode`) instead.
"""

from __future__ import annotations

import abc
import hashlib
import logging
import random
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar, cast

import msgspec

from slipstream.envs.context import EpisodeContext, Outcome
from slipstream.envs.task import SPLITS, Split, TaskSpec
from slipstream.schemas import Episode

Doc = msgspec.Meta
Role = Literal["observation", "policy"]

log = logging.getLogger(__name__)

OptionsT = TypeVar("OptionsT", bound=msgspec.Struct)


class Problem(msgspec.Struct, kw_only=True, frozen=True):
    """What an environment draws: a canonical key (the problem's identity), its prompt and answer."""

    key: str
    prompt: str
    reference: str


class Message(msgspec.Struct, kw_only=True, frozen=True):
    """One span of an episode's text: an observation (not trained) or a policy output (trained)."""

    role: Role
    text: str


class Transcript(msgspec.Struct, kw_only=True):
    """An episode in progress under `reset`/`step`: the task, its messages so far and env-private state.

    Not the wire `Episode` (slipstream.schemas), which is the finished episode as token samples."""

    task: TaskSpec
    messages: list[Message]
    done: bool = False
    turns: Annotated[int, Doc(description="Policy outputs taken so far.")] = 0
    state: Annotated[dict[str, Any], Doc(description="Environment-private state (budgets, seen ids).")] = {}

    @property
    def observation(self) -> str:
        """The latest observation: what the worker feeds the model next."""
        for message in reversed(self.messages):
            if message.role == "observation":
                return message.text
        return ""

    def completion(self) -> str:
        """Everything after the prompt, policy outputs and later observations interleaved."""
        return "".join(m.text for m in self.messages[1:])

    def policy_text(self) -> str:
        """Only the policy's outputs, concatenated: the tokens a loss is computed on."""
        return "".join(m.text for m in self.messages if m.role == "policy")


class StepResult(msgspec.Struct, kw_only=True, frozen=True):
    """What one step returns: the next observation (None when there is none) and whether it ended."""

    observation: str | None
    done: bool
    info: dict[str, str] = {}


class Score(msgspec.Struct, kw_only=True, frozen=True):
    """A verifier's judgement: `reward` is the sum of `components` (build it with `Score.of`)."""

    reward: float
    components: dict[str, float]
    correct: bool
    parse_ok: bool
    reason: str
    # Non-empty: this episode cannot be scored (the reason); its reward means nothing and it must
    # not be trained on as a 0 (a served episode with no feedback the reward spec uses).
    unscorable: str = ""

    @classmethod
    def of(cls, components: dict[str, float], *, correct: bool, parse_ok: bool, reason: str) -> Score:
        return cls(
            reward=sum(components.values()),
            components=dict(components),
            correct=correct,
            parse_ok=parse_ok,
            reason=reason,
        )


class Environment(abc.ABC, Generic[OptionsT]):
    """Base of every environment; subclasses set `Options`, `components` and implement `sample`, `grade`.

    Splits: a problem's canonical key is hashed with the environment name; one key in
    `heldout_one_in` is held out. The split depends on the key alone (not on options or seeds), so
    `generate("train", ...)` never yields a held-out problem, under any options.
    """

    name: ClassVar[str] = ""  # set by `registry.register`
    version: ClassVar[str] = "1"  # bump when prompts, parsing or reward change; part of scorer_version
    Options: ClassVar[type[msgspec.Struct]]
    components: ClassVar[tuple[str, ...]]  # reward component names, all present in every Score
    heldout_one_in: ClassVar[int] = 8
    terminator: ClassVar[str] = "\n"  # ends an answer; workers may use it as a stop string
    max_turns: ClassVar[int] = 1  # multi-turn environments raise it
    # Warm-start from the scripted expert's episodes (`expert`) instead of prompt + `sft_example`.
    warmstart_from_expert: ClassVar[bool] = False
    # With `warmstart_from_expert`: also train on the expert episodes' untrainable samples (frozen
    # sub-agents'), so one warm-start teaches the orchestrator and the sub-agents it will spawn (`swarm`).
    warmstart_frozen_samples: ClassVar[bool] = False
    # False for an environment that only scores recorded traffic (`serve`): it has no tasks to
    # generate, play or plan a run with (`registry.task_envs` leaves it out).
    has_tasks: ClassVar[bool] = True
    # An eval suite only (humaneval): every problem is held out, `generate("train", ...)` refuses.
    eval_only: ClassVar[bool] = False

    def __init__(self, options: OptionsT | None = None) -> None:
        if options is not None and not isinstance(options, self.Options):
            raise TypeError(f"{type(self).__name__} takes {self.Options.__name__}, got {type(options).__name__}")
        self.options: OptionsT = options if options is not None else cast(OptionsT, self.Options())

    # -- identity -------------------------------------------------------------------------------

    @property
    def scorer_version(self) -> str:
        """`name@version`, plus a digest of the options when they differ from the defaults."""
        base = f"{self.name}@{self.version}"
        if self.options == self.Options():
            return base
        digest = hashlib.blake2b(msgspec.json.encode(self.options), digest_size=4).hexdigest()
        return f"{base}+{digest}"

    @property
    def max_completion_chars(self) -> int:
        """Longest sensible single output in characters (answer + terminator): a decoding bound."""
        return 256

    # -- tasks ----------------------------------------------------------------------------------

    def split_of(self, key: str) -> Split:
        """Which split a canonical problem key belongs to (stable across processes and options)."""
        digest = hashlib.blake2b(f"{self.name}:{key}".encode(), digest_size=8).digest()
        return "heldout" if int.from_bytes(digest, "little") % self.heldout_one_in == 0 else "train"

    @abc.abstractmethod
    def sample(self, rng: random.Random) -> Problem:
        """Draw one problem (of either split) from this environment's distribution."""

    def generate(self, split: Split, n: int, seed: int) -> list[TaskSpec]:
        """`n` tasks of `split`, a pure function of (name, options, split, n, seed).

        Problems are drawn with replacement, so a small key space repeats; the first k tasks of a
        call are the same for every n >= k.
        """
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        # String seeds are hashed with SHA-512 by `random`, so streams do not depend on PYTHONHASHSEED.
        rng = random.Random(f"{self.name}|{split}|{seed}")
        max_draws = 1000 + 64 * n
        tasks: list[TaskSpec] = []
        draws = 0
        while len(tasks) < n:
            if draws >= max_draws:
                raise ValueError(
                    f"{self.name}: drew {draws} problems and found only {len(tasks)} of split {split!r}; "
                    f"options {msgspec.json.encode(self.options).decode()} leave too few {split} problems"
                )
            problem = self.sample(rng)
            draws += 1
            if self.split_of(problem.key) != split:
                continue
            tasks.append(
                TaskSpec(
                    task_id=f"{self.name}-{split}-{seed}-{len(tasks)}",
                    env=self.name,
                    prompt=problem.prompt,
                    reference=problem.reference,
                    seed=seed,
                    split=split,
                    metadata={"key": problem.key},
                )
            )
        return tasks

    def chat_messages(self, task: TaskSpec, prompt: str) -> list[dict[str, str]]:
        """The conversation a chat model (a tokenizer with a chat template) is shown for `prompt`,
        a sample's opening text (`EpisodeContext.open`).

        Default: the prompt as one user turn. Environments add system and demo turns here; the
        harness renders them with the model's own template, ending at the assistant's turn.
        """
        return [{"role": "user", "content": prompt}]

    def sft_example(self, task: TaskSpec) -> str:
        """The reference completion for supervised warm-start; the caller appends the tokenizer's eos."""
        return task.reference + self.terminator

    def drill_texts(self, n: int, seed: int) -> list[tuple[str, str]]:
        """`n` (context, target) texts of a skill the env's episodes need apart from what RL is to
        learn, drilled beside the teacher's episodes in the warm-start (`sft_drill_rows`; libs/supervised
        `drill_examples` encodes them, the target alone trained). The same for the same seed.
        An environment without a drill raises ValueError."""
        raise ValueError(f"env {self.name!r} has no skill drill: sft_drill_rows needs one (recall has)")

    def expert(self, task: TaskSpec, context: str) -> str:
        """A scripted expert's next output, given the decoded context so far (prompt included).

        The warm-start plays it like a model through the harness (libs/supervised scripted.py), so its episodes are laid
        out exactly as the policy's. The default answers single-turn tasks with `sft_example`.
        """
        return self.sft_example(task)

    def warmstart_frozen_rows(self) -> int | None:
        """With `warmstart_frozen_samples`: at most this many of an expert episode's untrainable
        samples train (its first ones, in spawn order); None: all. The default is all; `swarm` makes
        it an option, so the orchestrator's own rows are not outnumbered by its sub-agents'."""
        return None

    def probe_episode(self, task: TaskSpec, episode: Episode) -> bool:
        """Whether the warm-start's probe (greedy replay, libs/supervised `probe_items`) may measure
        this expert episode: one the teacher played cleanly, so replaying it token for token is the
        skill wanted. The default: solved, with no invalid call (an imperfect expert's guesses and
        slips are not). `swarm` also takes a serial teacher's partial answer, all it can do in budget."""
        return self.score(task, episode).correct and not episode.counts.get("invalid_tool_call", 0)

    def curate_expert_episodes(self, tasks: list[TaskSpec], episodes: list[Episode]) -> list[bool]:
        """Which of the expert's episodes (one per task, in order) warm-start the model.

        The default keeps all; an environment with a filter over its teacher's episodes
        (Context-1's SFT rules in `search`) overrides it.
        """
        return [True] * len(episodes)

    def eval_metrics(self, tasks: list[TaskSpec], episodes: list[Episode]) -> dict[str, float]:
        """Env-specific figures over evaluated episodes (one task per episode, in order), by name.

        The default has none; `search` reports Context-1's table (final-answer-found, recalls,
        F1, prune accuracy, tool calls per turn, turns per episode)."""
        return {}

    # -- episodes -------------------------------------------------------------------------------

    def reset(self, task: TaskSpec) -> Transcript:
        """Open an episode; its first observation is the prompt."""
        if task.env != self.name:
            raise ValueError(f"task {task.task_id!r} is for env {task.env!r}, not {self.name!r}")
        return Transcript(task=task, messages=[Message(role="observation", text=task.prompt)])

    def step(self, episode: Transcript, model_output: str) -> StepResult:
        """Record one policy output and advance; see the module docstring for the contract."""
        if episode.done:
            raise ValueError(f"episode of task {episode.task.task_id!r} is already done")
        if not isinstance(model_output, str):
            raise TypeError(f"model_output must be str, got {type(model_output).__name__}")
        episode.messages.append(Message(role="policy", text=model_output))
        episode.turns += 1
        result = self.transition(episode, model_output)
        if not result.done and episode.turns >= self.max_turns:
            result = StepResult(observation=None, done=True, info={**result.info, "truncated": "max_turns"})
        if result.observation is not None:
            episode.messages.append(Message(role="observation", text=result.observation))
        episode.done = result.done
        return result

    def transition(self, episode: Transcript, model_output: str) -> StepResult:
        """React to one policy output (tools, budgets). The default is single-turn: done, no observation."""
        return StepResult(observation=None, done=True)

    async def run(self, ctx: EpisodeContext) -> Outcome:
        """Play one episode. This default is the adapter onto `reset`/`step`.

        One root sample: the prompt, then each policy output (sampled) and each observation
        (tokenised, mask 0) appended in turn. The final text is the whole completion decoded, as
        the single-sample `Trajectory.completion_text` always was.
        """
        episode = self.reset(ctx.task)
        thread = ctx.open(episode.observation)
        while True:
            generation = await ctx.generate(thread)
            result = self.step(episode, generation.text)
            if result.done:
                finish = result.info.get("truncated", generation.finish_reason)
                return Outcome(final_text=thread.completion_text(), finish_reason=finish)
            ctx.observe(thread, result.observation or "")

    # -- scoring --------------------------------------------------------------------------------

    def score(self, task: TaskSpec, completion: str | Episode) -> Score:
        """Judge an episode (or just its completion text) against `task`; never raises.

        Given an `Episode`, `grade_episode` judges it and the components recorded during play
        (`EpisodeContext.reward`, `play_rewards`) are added to the verifier's.
        """
        if task.env != self.name:
            return self.failure(f"task {task.task_id!r} is for env {task.env!r}, not {self.name!r}")
        if isinstance(completion, Episode):
            if completion.is_stub():
                return self.failure(f"episode {completion.episode_id!r} is a by-reference stub; load its body first")
            return self._guarded(
                task, lambda: self._with_play_rewards(self.grade_episode(task, completion), completion)
            )
        if not isinstance(completion, str):
            return self.failure(f"completion is {type(completion).__name__}, not str or Episode")
        return self._guarded(task, lambda: self.grade(task, completion))

    def _guarded(self, task: TaskSpec, judge: Callable[[], Score]) -> Score:
        try:
            return judge()
        except Exception as exc:
            # Fall back to a failure score: one bad task must not stop the reward model; the reason
            # travels with the score so it is counted downstream.
            log.warning("%s: scorer error on task %s: %r", self.name, task.task_id, exc)
            return self.failure(f"scorer error: {type(exc).__name__}: {exc}")

    @staticmethod
    def _with_play_rewards(score: Score, episode: Episode) -> Score:
        extra = play_rewards(episode)
        if not extra:
            return score
        clash = sorted(set(extra) & set(score.components))
        if clash:
            raise ValueError(f"reward component(s) {clash} recorded during play clash with the verifier's")
        return Score.of(
            {**score.components, **extra}, correct=score.correct, parse_ok=score.parse_ok, reason=score.reason
        )

    def grade_episode(self, task: TaskSpec, episode: Episode) -> Score:
        """The verifier for a whole episode; the default grades its final text with `grade`."""
        return self.grade(task, episode.final_text)

    @abc.abstractmethod
    def grade(self, task: TaskSpec, completion: str) -> Score:
        """The rule-based verifier behind `score`; may assume `completion` is a str."""

    def failure(self, reason: str) -> Score:
        """The failure score: every component 0.0, reward 0.0, not parsed."""
        return Score.of(dict.fromkeys(self.components, 0.0), correct=False, parse_ok=False, reason=reason)


PLAY_REWARD_PREFIX = "reward."


def fixed_draw(text: str) -> float:
    """A number in [0, 1) fixed by `text` (the first 8 bytes of its blake2b digest): the experts'
    choices and slips as a function of the task, the same in every process and run."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def play_rewards(episode: Episode) -> dict[str, float]:
    """Reward components an environment recorded during play (metadata "reward.<name>")."""
    return {
        key[len(PLAY_REWARD_PREFIX) :]: float(value)
        for key, value in episode.metadata.items()
        if key.startswith(PLAY_REWARD_PREFIX)
    }


def task_of(episode: Episode) -> TaskSpec:
    """The environment's view of an episode's task (what `score` needs; the prompt is not kept)."""
    if episode.split not in SPLITS:
        raise ValueError(f"episode {episode.episode_id!r} has split {episode.split!r}; expected one of {SPLITS}")
    return TaskSpec(
        task_id=episode.task_id,
        env=episode.env,
        prompt="",
        reference=episode.reference,
        seed=0,
        split=cast(Split, episode.split),
        metadata=dict(episode.metadata),
    )
