"""Scoring one weight version on the pinned suite, with the same engine and harness as training.

`Evaluator` owns one TorchEngine (built from `[model]`: architecture and tokenizer; the weights
are replaced per version). `score(version, manifest_key)` fetches the version from the object
store (sha256-verified), applies it, waits until the engine samples with it, and rolls out every
suite task through `slipstream.harness.evaluate` — the rollout loop the workers train with.

Frozen agents (sub-agents, spawn with trainable=False) never play on the version under test: as
in the workers (`[subagents] pin_version` -1, the pool's default pin 0), they play on `[model]`
as loaded, version 0, on a `FrozenEngine` over a copy taken before any version is applied (its
engine built by the first sub-agent, so a suite without sub-agents holds only the copy). A
rollout whose frozen tokens came from any other version fails the evaluation.

Fetching reads a full snapshot directly; a delta version (from the chain codec) is rebuilt from
its last keyframe. A version that cannot be fetched or applied raises `Unloadable`.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from slipstream.engine.interface import Engine
from slipstream.engine.source import ModelSource
from slipstream.eval_gate.config import GateSection
from slipstream.eval_gate.suite import EnvSummary, EvalDetails, Suite, TaskScore
from slipstream.harness import SummaryConfig, evaluate
from slipstream.schemas import WeightManifest
from slipstream.store import ObjectStore
from slipstream.telemetry.logs import get_logger

if TYPE_CHECKING:
    import torch

    from slipstream.engine.engine import TorchEngine
    from slipstream.engine.tokenizer import Tokenizer

log = get_logger(__name__)
_TIED_ALIAS = {"lm_head.weight": "model.embed_tokens.weight"}
_SWITCH_TIMEOUT_S = 60.0


class Unloadable(Exception):
    """The version's weights could not be fetched, verified or applied."""


def fetch_weights(
    store: ObjectStore,
    manifest_key: str,
    run_id: str,
    check: Callable[[WeightManifest], None] | None = None,
) -> tuple[WeightManifest, dict[str, torch.Tensor]]:
    """Manifest and verified tensors of the version at `manifest_key` (blocking: run it in a thread).

    `check` (the announce verifier's signature step) sees every manifest read, the version's and
    those of its chain; a manifest it refuses makes the version Unloadable.
    """
    import msgspec

    from slipstream.weights import WeightsError, fetch_version, read_manifest

    try:
        manifest = read_manifest(store, manifest_key)
        if check is not None:
            check(manifest)
        if manifest.keyframe and all(s.codec == "raw" for s in manifest.shards):
            return fetch_version(store, manifest_key)
        # A zstd keyframe or a delta: the chain codec knows how to rebuild it.
        from slipstream.weights import load_version

        return manifest, load_version(store, manifest.run_id or run_id, manifest.policy_version, check=check)
    except (WeightsError, ValueError, msgspec.DecodeError) as exc:
        # Missing, corrupt or malformed: it will not get better. Store outages (OSError, botocore)
        # propagate instead, so the announcement is retried.
        raise Unloadable(f"cannot load weights at {manifest_key}: {exc}") from exc


class Evaluator:
    """One engine, one suite: `score` any stored version on it."""

    def __init__(
        self,
        engine: TorchEngine,
        tokenizer: Tokenizer,
        suite: Suite,
        store: ObjectStore,
        run_id: str,
        frozen_engine: Engine | None = None,
    ) -> None:
        self.engine = engine
        # Where sub-agents play: never `engine`, which holds the version under test (see the module doc).
        self.frozen_engine = frozen_engine
        self.tokenizer = tokenizer
        self.suite = suite
        self.store = store
        self.run_id = run_id
        self.check: Callable[[WeightManifest], None] | None = None  # the verifier's signature step, when set
        self._lock = asyncio.Lock()  # one evaluation at a time: the engine holds one version

    async def stop(self) -> None:
        """Stop the engine and the frozen one (if its engine was ever built)."""
        await self.engine.stop()
        if self.frozen_engine is not None:
            await self.frozen_engine.stop()

    async def score(self, version: int, manifest_key: str) -> EvalDetails:
        """Evaluate `version` (stored at `manifest_key`) on the suite; raises Unloadable."""
        async with self._lock:
            t0 = time.perf_counter()
            manifest, tensors = await asyncio.to_thread(
                fetch_weights, self.store, manifest_key, self.run_id, self.check
            )
            if manifest.policy_version != version:
                raise Unloadable(f"manifest {manifest_key} holds version {manifest.policy_version}, not {version}")
            await self._apply(version, tensors)
            details = await self._rollouts(version)
            details.manifest_key = manifest_key
            details.seconds = time.perf_counter() - t0
            return details

    async def _apply(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        try:
            self.engine.apply_weights(version, self._cast(tensors))
        except ValueError as exc:
            raise Unloadable(f"version {version} does not fit the model: {exc}") from exc
        deadline = time.monotonic() + _SWITCH_TIMEOUT_S
        # The engine copies queued weights in at its next step; it is idle, so that is at once.
        while self.engine.policy_version != version or self.engine.pending_version is not None:
            if self.engine.error is not None:
                raise Unloadable(f"engine failed while applying version {version}: {self.engine.error!r}")
            if time.monotonic() >= deadline:
                raise Unloadable(f"engine did not switch to version {version} within {_SWITCH_TIMEOUT_S}s")
            await asyncio.sleep(0.005)

    def _cast(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors in the engine's dtype and device (a bf16 snapshot into an fp32 engine, say)."""
        params = dict(self.engine.named_parameters())
        out: dict[str, torch.Tensor] = {}
        for name, value in tensors.items():
            target = params.get(name) if name in params else params.get(_TIED_ALIAS.get(name, ""))
            # Unknown names pass through: apply_weights rejects them, naming the tensor.
            out[name] = value if target is None else value.to(device=target.device, dtype=target.dtype)
        return out

    async def _rollouts(self, version: int) -> EvalDetails:
        suite = self.suite
        scores: list[TaskScore] = []
        envs: dict[str, EnvSummary] = {}
        for name, env in suite.envs.items():
            report = await evaluate(
                self.engine,
                self.tokenizer,
                env,
                suite.tasks[name],
                samples_per_task=suite.samples_per_task,
                params=suite.params[name],
                concurrency=max(1, self.engine.max_batch // suite.samples_per_task),
                summary=suite.summary,
                frozen_engine=self.frozen_engine,
            )
            pinned = [] if self.frozen_engine is None else [self.frozen_engine.policy_version]
            if report.frozen_versions and report.frozen_versions != pinned:
                # Sub-agents on the candidate (or with no frozen engine) score another system than the trained one.
                raise RuntimeError(
                    f"evaluation of version {version}: frozen agents sampled under versions {report.frozen_versions}, "
                    f"not the pinned {pinned or 'frozen engine (none given)'}"
                )
            if report.policy_versions != [version]:
                # Nothing else applies weights to this engine; if it happened, the scores are not this version's.
                raise RuntimeError(f"evaluation of version {version} sampled under versions {report.policy_versions}")
            for t in [] if name in suite.report_only else report.tasks:  # reported only: no decision rests on it
                per_sample = t.rewards if suite.metric == "reward" else [float(c) for c in t.correct]
                scores.append(
                    TaskScore(
                        task_id=t.task_id,
                        env=name,
                        score=sum(per_sample) / len(per_sample),
                        rewards=list(t.rewards),
                        correct=list(t.correct),
                        completions=list(t.completions),
                    )
                )
            envs[name] = EnvSummary(
                tasks=report.n_tasks,
                samples=report.n,
                accuracy=report.accuracy,
                mean_reward=report.mean_reward,
                parse_failures=report.parse_failures,
                scorer_version=report.scorer_version,
                restarts_per_episode=report.restarts / report.n if report.n else 0.0,
            )
        return EvalDetails(
            run_id=self.run_id,
            policy_version=version,
            suite=suite.name,
            fingerprint=suite.fingerprint,
            metric=suite.metric,
            score=sum(s.score for s in scores) / len(scores),
            tasks=scores,
            envs=envs,
            evaluated_at=time.time(),
        )


async def build_evaluator(
    model_source: ModelSource,
    gate: GateSection,
    store: ObjectStore,
    run_id: str,
    summary: SummaryConfig | None = None,
) -> Evaluator:
    """Load `[model]` into a started TorchEngine and pin the suite of `[gate]` (played with `[summary]`)."""
    from slipstream.engine.engine import TorchEngine
    from slipstream.engine.frozen import FrozenEngine
    from slipstream.engine.source import load_model, resolve_device, torch_dtype

    suite = Suite(gate, summary)  # first: a bad env or option fails before the model loads
    model, tokenizer = await asyncio.to_thread(load_model, model_source)
    # Copied before any version is applied: the sub-agents' weights, [model] as loaded (version 0).
    frozen_model = await asyncio.to_thread(copy.deepcopy, model)

    def torch_engine(m: Any, version: int) -> TorchEngine:
        return TorchEngine(
            m,
            tokenizer,
            max_batch=gate.max_batch,
            device=resolve_device(model_source),
            dtype=torch_dtype(model_source),
            seed=gate.seed,
            policy_version=version,
            # A LoRA run's versions are its adapters only; the frozen base stays as loaded.
            allow_partial_updates=model_source.lora_rank > 0,
        )

    engine = torch_engine(model, -1)  # holds no stored version until the first `score`
    await engine.start()
    frozen = FrozenEngine(frozen_model, lambda m: torch_engine(m, 0))
    return Evaluator(engine, tokenizer, suite, store, run_id, frozen_engine=frozen)
