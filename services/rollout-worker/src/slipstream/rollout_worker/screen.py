"""Screening a task before its group is sampled: skip most of the tasks whose group would be uniform.

GRPO learns nothing from a group whose rewards are all equal; the learner drops it as
`uniform_group`, and on the default demo that was 67-70% of every rollout. Whether a group will be
uniform is mostly decided by one number the worker can compute before sampling anything: the
probability p that sampling (at the worker's temperature) writes the task's reference completion.
For an exact-match task it is the chance one sample is right, so a group of G is mixed with chance

    P(mixed) = 1 - p^G - (1 - p)^G

(the informativeness the task source's pass-rate sampler uses, from a measured rate instead).
p costs one teacher-forced forward over the prompt and the reference (a few ms for the tiny
model), where the group costs G sampled completions. With `[worker] screen_target` = τ > 0 a task
is kept with probability min(1, P(mixed) / τ), drawn from a hash of its task id (so a redelivered
task gets the same answer); a task not kept is acked without a group (outcome `screened`), which
frees the task source's window at once.

What the screen changes, and what it does not: kept tasks are fresh draws from the generator
(no task is served twice, unlike the pass-rate sampler), and the learner still trains only the
groups that came out mixed. So the trained groups are drawn from the same tasks as without the
screen, weighted once more by P(mixed): the screen saves the rollouts that would have been dropped,
it does not pick a new curriculum. The prediction reads the env's reference, which only chooses
what to sample; the reward is the env's verifier as always.

When it applies: a single-turn env with a reference completion (`Environment.sft_example`), and an
engine that holds its model in this process (`TorchEngine`). Multi-turn envs (tool calls,
experts), an empty reference and the http engine are never screened (`screenable` says why not).
p is exact for byte-exact answers at top_p = 1 and top_k = 0; another correct spelling, or a
nucleus, makes it a lower bound (the screen then keeps fewer easy tasks than it should).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from typing import Any

import torch

from slipstream.engine.tokenizer import Tokenizer
from slipstream.envs import Environment
from slipstream.envs.task import TaskSpec
from slipstream.harness.episode import prompt_ids
from slipstream.schemas import Task


def informative_chance(p: float, group_size: int) -> float:
    """The chance that a group of `group_size` samples, each right with chance `p`, is not uniform."""
    p = min(max(p, 0.0), 1.0)
    return max(0.0, 1.0 - p**group_size - (1.0 - p) ** group_size)


def keep_chance(p_mixed: float, target: float) -> float:
    """The chance a task whose group is mixed with chance `p_mixed` is kept, at screen target `target`."""
    if not 0.0 < target <= 1.0:
        raise ValueError(f"screen target must be in (0, 1], got {target}")
    return min(1.0, p_mixed / target)


def draw(task_id: str) -> float:
    """A uniform draw in [0, 1) fixed by the task id: a redelivered task is screened the same way."""
    digest = hashlib.blake2b(f"screen/{task_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


class TaskScreen:
    """Predicts each task's pass chance from the engine's current weights and decides whether to sample it."""

    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, *, target: float, temperature: float) -> None:
        if not 0.0 < target <= 1.0:
            raise ValueError(f"[worker] screen_target must be in (0, 1] when on, got {target}")
        if not temperature > 0:
            raise ValueError(f"the screen needs a sampling temperature > 0, got {temperature}")
        self.model = model
        self.tokenizer = tokenizer
        self.target = target
        self.temperature = temperature
        self.kept = 0
        self.screened = 0
        self.skipped = 0  # tasks the screen could not judge (multi-turn env, no reference): sampled as usual
        self.p_mixed_sum = 0.0

    @staticmethod
    def screenable(env: Environment[Any], task: Task) -> str | None:
        """None when the screen can judge `task`, else why not."""
        if env.warmstart_from_expert:
            return f"env {env.name!r} is multi-turn (its warm-start plays an expert)"
        if not task.reference:
            return "the task has no reference completion"
        return None

    def sequence(self, env: Environment[Any], task: Task) -> tuple[list[int], int]:
        """(ids of the prompt as the harness opens it + the reference as sampled, prompt length).

        The reference is `env.sft_example` (reference + terminator) without eos: the worker stops
        at the terminator, so eos is never sampled.
        """
        spec = TaskSpec.from_task(task)
        template = getattr(self.tokenizer, "chat_template", None)
        if template is None:
            prompt = prompt_ids(self.tokenizer, task.prompt)
        else:
            messages = env.chat_messages(spec, task.prompt)
            prompt = self.tokenizer.encode(template.render(messages, add_generation_prompt=True))
        return [*prompt, *self.tokenizer.encode(env.sft_example(spec))], len(prompt)

    def pass_chance(self, env: Environment[Any], task: Task) -> float:
        """p: the probability that one sample at the worker's temperature writes the reference."""
        ids, prompt_len = self.sequence(env, task)
        return math.exp(self.logprob(ids, prompt_len))

    def logprob(self, ids: list[int], prompt_len: int) -> float:
        """log P(ids[prompt_len:] | ids[:prompt_len]) at the worker's temperature, teacher-forced."""
        device = next(self.model.parameters()).device
        inputs = torch.tensor([ids[:-1]], device=device)
        targets = torch.tensor(ids[prompt_len:], device=device)
        with torch.no_grad():
            logits = self.model(inputs)[0, prompt_len - 1 :].float() / self.temperature
        return float(torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).sum())

    async def keep(self, env: Environment[Any], task: Task) -> bool:
        """Whether to sample `task`'s group (True for a task the screen cannot judge)."""
        if self.screenable(env, task) is not None:
            self.skipped += 1
            return True
        p = await asyncio.to_thread(self.pass_chance, env, task)
        p_mixed = informative_chance(p, task.group_size)
        self.p_mixed_sum += p_mixed
        if draw(task.task_id) < keep_chance(p_mixed, self.target):
            self.kept += 1
            return True
        self.screened += 1
        return False

    def status(self) -> dict[str, Any]:
        judged = self.kept + self.screened
        return {
            "target": self.target,
            "kept": self.kept,
            "screened": self.screened,
            "not_judged": self.skipped,
            "mean_p_mixed": round(self.p_mixed_sum / judged, 4) if judged else None,
        }
