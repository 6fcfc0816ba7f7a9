"""A frozen engine: weights nobody updates, an engine built on first use.

Frozen sub-agents (spawn with trainable=False) play on weights that announcements never touch:
a deep copy of the model taken when it was loaded (version 0), before the live engine exists.
The rollout worker (`[subagents] transport = "local"`), the eval-gate and the CLI's held-out
evaluations each keep one, so the version under test or training never plays its sub-agents. The copy is cheap to
keep, an engine is not: a `TorchEngine` allocates its KV cache for `max_batch` x `max_seq_len`
when it is built, which would double every worker's cache even when its environment never
spawns. So the engine over the copy is built and started by the first sub-agent call, and most
workers (envs without sub-agents) only ever hold the copy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from slipstream.engine.interface import Engine, GenerationRequest, GenerationResult


class FrozenEngine:
    """An `Engine` over a frozen copy of the weights; `apply_weights` is refused by design."""

    def __init__(self, model: Any, build: Callable[[Any], Engine], *, policy_version: int = 0) -> None:
        self._model = model
        self._build = build
        self._version = policy_version
        self._engine: Engine | None = None
        self._lock = asyncio.Lock()

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def started(self) -> bool:
        """Whether a sub-agent has run (the engine, and its KV cache, exist)."""
        return self._engine is not None

    async def start(self) -> None:
        """Nothing until the first call: see the module docstring."""

    async def _ready(self) -> Engine:
        if self._engine is None:
            async with self._lock:
                if self._engine is None:
                    engine = self._build(self._model)
                    await engine.start()
                    self._engine = engine
        return self._engine

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        engine = await self._ready()
        return await engine.generate(request)

    async def stop(self) -> None:
        if self._engine is not None:
            await self._engine.stop()

    def apply_weights(self, version: int, tensors: Mapping[str, Any]) -> None:
        raise RuntimeError(f"the frozen sub-agent engine keeps version {self._version}; version {version} refused")

    def named_parameters(self) -> Iterator[tuple[str, Any]]:
        return iter(self._model.named_parameters())

    def state_dict(self) -> Mapping[str, Any]:
        return dict(self._model.state_dict())

    def release(self, session_id: str) -> None:
        if self._engine is not None:
            self._engine.release(session_id)

    def stats(self) -> dict[str, float]:
        return self._engine.stats() if self._engine is not None else {}
