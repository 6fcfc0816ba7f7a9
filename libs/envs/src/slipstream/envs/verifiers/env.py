"""`verifiers`: a verifiers v1 environment (taskset, harness, judges) trained on Slipstream.

    [env]
    name = "verifiers"
    [env.options]
    python = ".venv-vf/bin/python"            # verifiers' own interpreter (see below)
    pythonpath = ["examples/verifiers-envs"]  # where the taskset modules live
    env = { taskset = { id = "vf_sum" }, agent = { harness = { id = "null" }, runtime = { type = "subprocess" } } }

`env` is a verifiers `EnvConfig` (0.4's config-driven `verifiers.v1` API), built on the verifiers
side by `load_environment`: the env, its taskset, each agent's harness and the judges are
verifiers' own code. A Slipstream task is an index into the taskset (`tasks` of them; the base
class's hash of the key holds one in `heldout_one_in` out). Playing a task:

1. the episode registers with this process's `bridge.Bridge` (a loopback `/inference/v1/generate`
   route plus the runner process) under a fresh key;
2. the runner (`runner.py`, under `python`) plays the verifiers episode; its harness's training
   client (`TrainClientConfig`: the `renderers` package renders the prompt to ids on its side)
   calls the route with `X-Slipstream-Episode: <key>`, and each call is sampled through this
   episode's context: the prompt ids as the harness rendered them (`open_ids`, or `observe_ids`
   for what a later turn adds), the sampled ids and log-probs returned exactly (vLLM's shape);
3. verifiers' rewards and judges (`Trace.rewards`, weighted) come back by name and are recorded
   as reward components `vf.<name>` (summed into the reward; `correct` is a sum >= `correct_at`).

So what trains is token for token what the harness was served. verifiers 0.4 pins openai < 3 and
the project openai >= 3, so verifiers lives in its own venv (`python`); `make verifiers-venv`
builds `.venv-vf`. `renderer_model = "byte"` gives the renderer the byte-level tokenizer of the
tiny models with `chat_template`; otherwise it names an HF tokenizer (a model directory).
"""

from __future__ import annotations

import hashlib
import json
import random
import tempfile
from pathlib import Path
from typing import Annotated, Any, ClassVar

import msgspec

from slipstream.envs.base import Environment, Problem, Score, TaskSpec, play_rewards
from slipstream.envs.context import EpisodeContext, Outcome
from slipstream.envs.registry import register
from slipstream.envs.verifiers.bridge import EPISODE_HEADER, Bridge
from slipstream.schemas import Episode

Doc = msgspec.Meta

PREFIX = "vf."
# Role: content lines, the byte models' plain layout; tool calls as Hermes/Qwen3-style tags.
BYTE_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}assistant: {{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments if c.function.arguments is string '
    "else c.function.arguments | tojson }}}</tool_call>{% endfor %}{{ eos_token }}\n"
    "{% elif m['role'] == 'tool' %}tool: {{ m['content'] }}\n"
    "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


class VerifiersOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Options of `verifiers`: the verifiers env config and where verifiers runs."""

    env: Annotated[dict[str, Any], Doc(description="The verifiers EnvConfig (taskset, agents, judges).")] = {}
    python: Annotated[str, Doc(description="verifiers' interpreter (its own venv: openai < 3).")] = ""
    pythonpath: Annotated[list[str], Doc(description="Directories holding the taskset modules.")] = []
    tasks: Annotated[int, Doc(description="Taskset tasks used: a task is an index below this.")] = 64
    model: Annotated[str, Doc(description="The model name the harness asks for.")] = "slipstream"
    renderer_model: Annotated[
        str, Doc(description="'byte' (the tiny models' tokenizer with chat_template) or an HF tokenizer path.")
    ] = "byte"
    chat_template: Annotated[str, Doc(description="Jinja chat template for renderer_model 'byte'.")] = BYTE_TEMPLATE
    renderer: Annotated[
        dict[str, Any], Doc(description="renderers' DefaultRendererConfig fields, e.g. {tool_parser = 'qwen3'}.")
    ] = {}
    sampling: Annotated[dict[str, Any], Doc(description="verifiers Sampling fields (max_tokens, ...).")] = {}
    max_tokens_limit: Annotated[int, Doc(description="Largest max_tokens one generate call may ask.")] = 512
    correct_at: Annotated[float, Doc(description="A summed reward at least this counts as correct.")] = 1.0
    max_concurrent: Annotated[
        int,
        Doc(
            description="Episodes one process plays at once through its runner (each starts the harness's chat "
            "program and its tool servers: ~200 MB and a core's start-up each); the rest wait their turn."
        ),
    ] = 8

    def __post_init__(self) -> None:
        taskset = self.env.get("taskset")
        if not isinstance(taskset, dict) or not taskset.get("id"):
            raise ValueError(
                "options.env must be a verifiers EnvConfig with a taskset id (env = {taskset = {id = ...}})"
            )
        if not self.python:
            raise ValueError(
                "options.python must name verifiers' interpreter: verifiers 0.4 pins openai < 3 and Slipstream "
                "openai >= 3, so it has its own venv (make verifiers-venv: .venv-vf/bin/python)"
            )
        if not Path(self.python).exists():
            raise ValueError(f"options.python {self.python!r} does not exist (make verifiers-venv builds .venv-vf)")
        missing = [p for p in self.pythonpath if not Path(p).is_dir()]
        if missing:
            raise ValueError(f"options.pythonpath has no directory {missing}")
        if self.tasks < 1 or self.max_tokens_limit < 1:
            raise ValueError(f"need tasks >= 1 and max_tokens_limit >= 1, got {self.tasks}, {self.max_tokens_limit}")
        if self.max_concurrent < 1:
            raise ValueError(f"options.max_concurrent must be >= 1, got {self.max_concurrent}")


def byte_renderer_dir(template: str) -> str:
    """An HF tokenizer directory for the byte-level tokenizer with `template`, written once per template."""
    from slipstream.engine.tokenizer import ByteTokenizer

    digest = hashlib.blake2b(template.encode(), digest_size=6).hexdigest()
    directory = Path(tempfile.gettempdir()) / f"slipstream-vf-byte-{digest}"
    config = directory / "tokenizer_config.json"
    if not config.exists():
        staging = Path(tempfile.mkdtemp(prefix="slipstream-vf-byte-"))
        ByteTokenizer().save(staging)
        written = json.loads((staging / "tokenizer_config.json").read_text())
        written["chat_template"] = template
        (staging / "tokenizer_config.json").write_text(json.dumps(written, indent=2))
        try:
            staging.rename(directory)
        except OSError:
            pass  # another process wrote the same directory first
    return str(directory)


@register("verifiers")
class Verifiers(Environment[VerifiersOptions]):
    """A verifiers v1 environment played by its own harness against this episode (module docstring)."""

    Options = VerifiersOptions
    version: ClassVar[str] = "1"
    components: ClassVar[tuple[str, ...]] = ()  # verifiers' reward names, per env config
    terminator: ClassVar[str] = ""  # the harness decides when a turn ends
    max_turns: ClassVar[int] = 64

    @property
    def scorer_version(self) -> str:
        """`verifiers@<version>+<digest of the options>`: the options (the verifiers env config above
        all) are what scores; they have no valid default to compare with, so the digest is always there."""
        digest = hashlib.blake2b(msgspec.json.encode(self.options), digest_size=4).hexdigest()
        return f"{self.name}@{self.version}+{digest}"

    @property
    def max_completion_chars(self) -> int:
        return 4 * self.options.max_tokens_limit

    def sample(self, rng: random.Random) -> Problem:
        return Problem(key=f"task-{rng.randrange(self.options.tasks)}", prompt="", reference="")

    def task_index(self, task: TaskSpec) -> int:
        key = str(task.metadata.get("key", ""))
        if not key.startswith("task-"):
            raise ValueError(f"task {task.task_id!r} carries no taskset index (metadata key {key!r})")
        return int(key.removeprefix("task-"))

    def ask(self, task: TaskSpec, key: str, base_url: str) -> dict[str, Any]:
        """The runner's request for one episode of `task`, its calls marked with `key`."""
        opts = self.options
        renderer_model = byte_renderer_dir(opts.chat_template) if opts.renderer_model == "byte" else opts.renderer_model
        return {
            "env": opts.env,
            "task": self.task_index(task),
            "base_url": base_url,
            "headers": {EPISODE_HEADER: key},
            "model": opts.model,
            "renderer_model": renderer_model,
            "renderer": opts.renderer,
            "sampling": opts.sampling,
        }

    async def run(self, ctx: EpisodeContext) -> Outcome:
        from slipstream.envs.verifiers.bridge import Link

        opts = self.options
        bridge = await Bridge.get(
            opts.python, list(opts.pythonpath), opts.model, opts.max_tokens_limit, opts.max_concurrent
        )
        key = f"{ctx.task.task_id}-{random.getrandbits(48):012x}"
        async with bridge.slots:
            link = bridge.route.links[key] = Link(ctx)
            try:
                answer = await bridge.runner.ask(self.ask(ctx.task, key, bridge.route.base_url))
            finally:
                del bridge.route.links[key]
        if link.calls == 0:
            raise RuntimeError(f"the verifiers episode of {ctx.task.task_id!r} never sampled: {answer.get('errors')}")
        for name, value in sorted(answer.get("rewards", {}).items()):
            ctx.reward(PREFIX + name, float(value))
        ctx.count("vf_calls", link.calls)
        ctx.count("vf_samples", link.samples)
        if answer.get("errors"):
            ctx.count("vf_errors", len(answer["errors"]))
        finish = "stop" if answer.get("ok") else "error"
        return Outcome(
            final_text=str(answer.get("reply") or (link.texts[-1] if link.texts else "")), finish_reason=finish
        )

    def grade_episode(self, task: TaskSpec, episode: Episode) -> Score:
        """verifiers scored the episode during play (`reward.vf.<name>`); this only reads the verdict."""
        played = {k: v for k, v in play_rewards(episode).items() if k.startswith(PREFIX)}
        if not played:
            return self.failure(f"episode {episode.episode_id!r} has no verifiers reward recorded")
        total = sum(played.values())
        reason = ", ".join(f"{k}={v:g}" for k, v in sorted(played.items()))
        return Score.of({}, correct=total >= self.options.correct_at, parse_ok=True, reason=reason)

    def grade(self, task: TaskSpec, completion: str) -> Score:
        return self.failure("a verifiers episode is scored by verifiers during play; a completion text has no reward")
