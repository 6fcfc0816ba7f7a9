"""`vf_sum`: a single-turn verifiers v1 taskset: add two one-digit numbers.

The task is the question; its rewards are verifiers' own reward hooks: `exact`, 1.0 when the
reply, stripped, is the sum; and `close` (weight 0.5), how near the reply's first character is to
the sum's first digit (1 - |difference of their codes| / 256): a shaped signal that differs
between any two replies starting differently, so even a model that never answers right gets
groups with a baseline to beat. Seeded: task i is the same question in every process.

    env = { taskset = { id = "vf_sum" }, agent = { harness = { id = "null" }, runtime = { type = "subprocess" } } }
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def exact(self, task: SumData, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply.strip() == task.answer else 0.0

    @vf.reward(weight=0.5)
    async def close(self, task: SumData, trace: vf.Trace) -> float:
        reply = trace.last_reply
        return 1.0 - abs(ord(reply[0]) - ord(task.answer[0])) / 256 if reply else 0.0


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    INFINITE = True

    def load(self) -> Iterator[SumTask]:
        i = 0
        while True:
            rng = random.Random(f"vf_sum-{i}")
            a, b = rng.randrange(10), rng.randrange(10)
            yield SumTask(SumData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)
            i += 1


__all__ = ["SumTaskset"]
