"""`TaskSpec`: one generated task as an environment knows it, and the splits a task can be in.

Its own module because both sides of an episode read it: the environment (base.py) generates and
scores tasks, and the context it plays in (context.py) is handed one.
"""

from __future__ import annotations

from typing import Annotated, Literal, cast, get_args

import msgspec

from slipstream.schemas import Task

Doc = msgspec.Meta
Split = Literal["train", "heldout"]
SPLITS: tuple[str, ...] = get_args(Split)


class TaskSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One generated task, as the environment knows it; travels as a `slipstream.schemas.Task`."""

    task_id: Annotated[str, Doc(description="Unique per (env, split, seed, index); the advantage group key.")]
    env: Annotated[str, Doc(description="Registered environment name.")]
    prompt: Annotated[str, Doc(description="First observation shown to the policy.")]
    reference: Annotated[str, Doc(description="Reference answer for the verifier; never shown to the policy.")]
    seed: Annotated[int, Doc(description="Seed of the `generate` call that produced this task.")]
    split: Annotated[Split, Doc(description="'train' or 'heldout'.")]
    metadata: Annotated[dict[str, str], Doc(description="String tags; 'key' is the canonical problem key.")] = {}

    def to_task(self, *, run_id: str = "", group_size: int = 1, created_at: float = 0.0) -> Task:
        """The wire form, with the dispatch fields only the task source knows."""
        return Task(
            task_id=self.task_id,
            env=self.env,
            prompt=self.prompt,
            reference=self.reference,
            seed=self.seed,
            split=self.split,
            metadata=dict(self.metadata),
            run_id=run_id,
            group_size=group_size,
            created_at=created_at,
        )

    @classmethod
    def from_task(cls, task: Task) -> TaskSpec:
        """Back from the wire; a split other than 'train'/'heldout' is an error naming it."""
        if task.split not in SPLITS:
            raise ValueError(f"task {task.task_id!r} has split {task.split!r}; expected one of {SPLITS}")
        return cls(
            task_id=task.task_id,
            env=task.env,
            prompt=task.prompt,
            reference=task.reference,
            seed=task.seed,
            split=cast(Split, task.split),
            metadata=dict(task.metadata),
        )
