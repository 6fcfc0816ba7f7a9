"""`vf_lookup`: a multi-turn verifiers v1 taskset with a tool.

The model is asked for the value stored under a key; the values are not in the prompt, only
behind the `lookup` tool (a verifiers `Toolset`, served over MCP by verifiers for the harness).
A good episode calls `lookup(key)`, reads the tool's answer and replies with the value. Rewards
(verifiers reward hooks): `exact`, 1.0 when the final reply is the value; `looked_up` (weight
0.25), 1.0 when the trace holds a call of the tool. Seeded: task i is the same in every process.

    env = { taskset = { id = "vf_lookup" }, agent = { harness = { id = "null" }, runtime = { type = "subprocess" } } }
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import verifiers.v1 as vf

KEYS = [f"k{i}" for i in range(10)]


def table(key: str) -> str:
    """The value stored under `key`: a fixed function of the key."""
    return str(random.Random(f"vf_lookup-{key}").randrange(100))


class LookupToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the tool is advertised as plain `lookup`

    @vf.tool
    def lookup(self, key: str) -> str:
        """The value stored under `key` (k0 ... k9)."""
        return table(key) if key in KEYS else f"no key {key!r}"


class LookupTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class LookupData(vf.TaskData):
    key: str
    answer: str


class LookupTask(vf.Task[LookupData, vf.State, LookupTaskConfig]):
    @classmethod
    def toolsets(cls, config: LookupTaskConfig) -> list[vf.Toolset]:
        return [LookupToolset(config.tools)]

    @vf.reward
    async def exact(self, task: LookupData, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply.strip() == task.answer else 0.0

    @vf.reward(weight=0.25)
    async def looked_up(self, trace: vf.Trace) -> float:
        return 1.0 if any(m.role == "tool" for m in trace.messages) else 0.0


class LookupConfig(vf.TasksetConfig):
    task: LookupTaskConfig = LookupTaskConfig()


class LookupTaskset(vf.Taskset[LookupTask, LookupConfig]):
    INFINITE = True

    def load(self) -> Iterator[LookupTask]:
        i = 0
        while True:
            key = random.Random(f"vf_lookup-task-{i}").choice(KEYS)
            yield LookupTask(
                LookupData(prompt=f"What is stored under {key}?", key=key, answer=table(key)), self.config.task
            )
            i += 1


if __name__ == "__main__":
    LookupToolset.run()

__all__ = ["LookupTaskset"]
