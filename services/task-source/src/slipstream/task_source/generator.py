"""The task generator: an endless, deterministic stream of tasks, round-robin over the configured environments.

Each environment's `generate(split, n, seed)` is a pure function, so tasks are drawn in chunks of
`CHUNK` with seed `seed × 1_000_000 + chunk`: the k-th task of an environment is the same in
every process given (seed, options, split). Task ids are `<run_id>:<env task id>`
(e.g. `dev:arith-train-3000001-17`), unique within a run and across runs that share a bus, and
the msg id of the publish, so a repeat inside the stream's duplicate window is stored once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from slipstream.envs import Environment, Split, TaskSpec, get_env
from slipstream.schemas import Task

CHUNK = 64
_SEED_STRIDE = 1_000_000


def chunk_seed(seed: int, chunk: int) -> int:
    return seed * _SEED_STRIDE + chunk


class TaskGenerator:
    def __init__(
        self,
        envs: Sequence[str],
        *,
        env_options: Mapping[str, Mapping[str, Any]] | None = None,
        split: Split = "train",
        seed: int = 0,
        group_size: int = 1,
        run_id: str = "",
    ) -> None:
        if not envs:
            raise ValueError("TaskGenerator needs at least one environment")
        options = env_options or {}
        # Built (and options checked) now: an unknown env or bad option fails the service's setup.
        self.envs: list[Environment[Any]] = [get_env(name, **dict(options.get(name, {}))) for name in envs]
        self.split = split
        self.seed = seed
        self.group_size = group_size
        self.run_id = run_id
        self.count = 0  # tasks handed out
        self._per_env = [0] * len(self.envs)
        self._chunks: list[tuple[int, list[TaskSpec]]] = [(-1, []) for _ in self.envs]
        for i in range(len(self.envs)):
            # The first chunk now: options that leave too few problems of the split fail at start.
            self._spec(i, 0)

    def _spec(self, env_index: int, k: int) -> TaskSpec:
        chunk, offset = divmod(k, CHUNK)
        cached_chunk, specs = self._chunks[env_index]
        if cached_chunk != chunk:
            specs = self.envs[env_index].generate(self.split, CHUNK, chunk_seed(self.seed, chunk))
            self._chunks[env_index] = (chunk, specs)
        return specs[offset]

    def next(self, *, min_policy_version: int, now: float) -> Task:
        """The next task (advances the stream)."""
        i = self.count % len(self.envs)
        spec = self._spec(i, self._per_env[i])
        self._per_env[i] += 1
        self.count += 1
        task = spec.to_task(run_id=self.run_id, group_size=self.group_size, created_at=now)
        return msgspec.structs.replace(
            task, task_id=f"{self.run_id}:{spec.task_id}", min_policy_version=min_policy_version
        )
