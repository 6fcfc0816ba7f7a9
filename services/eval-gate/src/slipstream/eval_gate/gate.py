"""The gate's work on one candidate version: evaluate, compare with the promoted one, decide, commit.

    judge(version)  = score the candidate on the pinned suite
                      + the promoted version's per-task scores on the same tasks (its stored
                        details when comparable, else evaluated again and stored)
                      -> decide(...) (decision.py, a pure function)
    commit(verdict) = details to the object store -> eval.result (msg id run:version:suite)
                      -> EvalHistory.record -> on promotion: EvalHistory.promote + weights.promoted

`consider(announce)` is what the service runs per announcement: it skips what is not due, and
makes redelivery safe. A version that already has a recorded result is not evaluated again: its
commit is completed (a promotion recorded but never applied or never announced is finished with
the same message ids, so the stream keeps one copy) and nothing else changes — in particular a
redelivered announce never re-promotes a version an operator has rolled back since.

Version 0 (the initial weights) is due like any multiple of `every_n_versions` and goes through
the same rule; with nothing promoted only the floor applies, so with the default floor 0.0 the
initial weights become the first promoted version: the baseline every later one is compared with.

A candidate older than the promoted version is never promoted (with several gate replicas, or
after a manual promote, versions can be judged out of order).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from dataclasses import dataclass

from slipstream.bus import Bus
from slipstream.control import EvalHistory
from slipstream.eval_gate import pointer
from slipstream.eval_gate.config import GateSection
from slipstream.eval_gate.decision import Decision, decide
from slipstream.eval_gate.evaluator import Evaluator, Unloadable
from slipstream.eval_gate.instruments import (
    EVAL_SECONDS,
    PROMOTED,
    PROMOTED_VERSION,
    REJECTED,
    SCORE,
    SCORED_VERSION,
    SKIPPED,
)
from slipstream.eval_gate.suite import EvalDetails, decode_details, details_key, encode_details
from slipstream.schemas import EvalResult, WeightAnnounce, WeightsPromoted
from slipstream.schemas.subjects import EVAL_RESULT
from slipstream.store import ObjectNotFound, ObjectStore
from slipstream.telemetry.logs import get_logger
from slipstream.weights import manifest_key as layout_manifest_key

log = get_logger(__name__)
_LOG_SCAN = 1000  # promotion-log entries read to learn whether a version was ever promoted


@dataclass
class Verdict:
    """A judged candidate: the summary that goes on the bus and the details that go to the store."""

    result: EvalResult
    decision: Decision
    details: EvalDetails
    manifest_key: str


class Gate:
    """Judges and commits candidates of one run on one suite."""

    def __init__(
        self,
        cfg: GateSection,
        *,
        run_id: str,
        evaluator: Evaluator,
        store: ObjectStore,
        evals: EvalHistory,
        bus: Bus,
        store_baselines: bool = True,
    ) -> None:
        self.cfg = cfg
        self.store_baselines = store_baselines  # False: a dry run (`slipstream eval`) writes nothing
        self.run_id = run_id
        self.evaluator = evaluator
        self.store = store
        self.evals = evals
        self.bus = bus
        self.suite = evaluator.suite
        self.last: EvalResult | None = None
        self.evaluating: int | None = None
        self.fence_token = 0  # highest fencing token seen on an announce of this run

    def due(self, version: int) -> bool:
        return version % self.cfg.every_n_versions == 0

    # -- the service's entry ---------------------------------------------------------------------
    async def consider(self, announce: WeightAnnounce) -> str:
        """Handle one announcement; returns what happened (a word for logs and tests).

        Raises ControlUnavailable while Redis is down and bus/store errors: the caller hands the
        announcement back for later.
        """
        version = announce.policy_version
        if announce.run_id and announce.run_id != self.run_id:
            SKIPPED.add(reason="other_run")
            return "other_run"
        if 0 < announce.fence_token < self.fence_token:
            # Announced after a newer leader's version: its learner no longer leads the run.
            SKIPPED.add(reason="fenced")
            log.warning(
                "candidate from a deposed learner; not evaluated",
                version=version,
                fence_token=announce.fence_token,
                newest_fence_token=self.fence_token,
            )
            return "fenced"
        self.fence_token = max(self.fence_token, announce.fence_token)
        if not self.due(version):
            SKIPPED.add(reason="not_due")
            return "not_due"
        existing = await self.evals.get(version)
        if existing is not None and existing.suite == self.suite.name:
            return await self._resume(existing, announce.manifest_key)
        promoted = await self.evals.promoted()
        if promoted is not None and version < promoted:
            SKIPPED.add(reason="older_than_promoted")
            log.info("candidate older than the promoted version; not evaluated", version=version, promoted=promoted)
            return "older_than_promoted"
        verdict = await self.judge(version, announce.manifest_key)
        promoted_now = await self.commit(verdict)
        return "promoted" if promoted_now else "rejected"

    # -- judge -----------------------------------------------------------------------------------
    async def judge(self, version: int, manifest_key: str) -> Verdict:
        """Evaluate `version` and decide against the promoted version.

        Changes nothing outside but the cache of baseline details (see `baseline`).
        """
        promoted = await self.evals.promoted()
        self.evaluating = version
        t0 = time.perf_counter()
        try:
            try:
                details = await self.evaluator.score(version, manifest_key)
            except Unloadable as exc:
                return self._unloadable(version, manifest_key, str(exc))
            baseline = None
            if promoted is not None:
                baseline = details if promoted == version else await self.baseline(promoted)
        finally:
            self.evaluating = None
        EVAL_SECONDS.observe(time.perf_counter() - t0)
        SCORE.set(details.score, suite=self.suite.name)
        SCORED_VERSION.set(float(version), suite=self.suite.name)
        cfg = self.cfg
        decision = decide(
            details.scores,
            None if baseline is None else baseline.scores,
            margin=cfg.margin,
            confidence=cfg.confidence,
            floor=cfg.floor,
            min_samples=cfg.min_samples,
            baseline_version=promoted,
        )
        if decision.promote and promoted is not None and version < promoted:
            decision = _older(decision, promoted)
        return self._verdict(version, manifest_key, decision, details, promoted if baseline is not None else None)

    async def baseline(self, version: int) -> EvalDetails | None:
        """The promoted version's details on this suite: stored ones if comparable, else measured now
        (and stored, unless `store_baselines` is off).

        None when the promoted version's weights cannot be loaded (then only the floor applies).
        """
        key = details_key(self.run_id, version, self.suite.name)
        try:
            stored = decode_details(await asyncio.to_thread(self.store.get, key))
            if self.suite.comparable(stored):
                return stored
            log.info("stored baseline details are from another suite; evaluating again", version=version)
        except ObjectNotFound:
            log.info("no stored details of the promoted version; evaluating it", version=version)
        try:
            details = await self.evaluator.score(version, layout_manifest_key(self.run_id, version))
        except Unloadable as exc:
            log.error(
                "promoted version cannot be loaded; comparing with the floor only", version=version, error=str(exc)
            )
            return None
        if self.store_baselines:
            await asyncio.to_thread(self.store.put, key, encode_details(details))
        return details

    def _verdict(
        self, version: int, manifest_key: str, decision: Decision, details: EvalDetails, baseline_version: int | None
    ) -> Verdict:
        details.decision, details.reason, details.baseline_version = (
            decision.decision,
            decision.reason,
            baseline_version,
        )
        score = _finite(decision.score, 0.0)
        result = EvalResult(
            policy_version=version,
            suite=self.suite.name,
            score=score,
            ci_low=_finite(decision.ci_low, score),
            ci_high=_finite(decision.ci_high, score),
            n_samples=decision.n,
            baseline_version=baseline_version,
            baseline_score=None if decision.baseline_score is None else _finite(decision.baseline_score, 0.0),
            decision=decision.decision,
            reason=decision.reason,
            details_key=details_key(self.run_id, version, self.suite.name),
            run_id=self.run_id,
            evaluated_at=time.time(),
        )
        return Verdict(result, decision, details, manifest_key)

    def _unloadable(self, version: int, manifest_key: str, why: str) -> Verdict:
        decision = Decision(False, f"unloadable: {why}", 0.0, 0.0, 0.0, None, None, None, 0, None, "unloadable")
        details = EvalDetails(
            run_id=self.run_id,
            policy_version=version,
            suite=self.suite.name,
            fingerprint=self.suite.fingerprint,
            metric=self.suite.metric,
            score=0.0,
            tasks=[],
            envs={},
            evaluated_at=time.time(),
            manifest_key=manifest_key,
        )
        return self._verdict(version, manifest_key, decision, details, None)

    # -- commit ----------------------------------------------------------------------------------
    async def commit(self, verdict: Verdict) -> bool:
        """Store, publish and record the verdict; promote when it says so. True if promoted."""
        result, version = verdict.result, verdict.result.policy_version
        if verdict.decision.promote:
            # Another replica (or an operator) may have promoted a newer version meanwhile.
            now = await self.evals.promoted()
            if now is not None and version < now:
                verdict.decision = _older(verdict.decision, now)
                result.decision, result.reason = verdict.decision.decision, verdict.decision.reason
                verdict.details.decision, verdict.details.reason = result.decision, result.reason
        await asyncio.to_thread(self.store.put, result.details_key, encode_details(verdict.details))
        await self.bus.publish(EVAL_RESULT, result, msg_id=f"{self.run_id}:{version}:{result.suite}")
        await self.evals.record(result)
        self.last = result
        log.info(
            "version judged",
            policy_version=version,
            decision=result.decision,
            score=round(result.score, 4),
            baseline_version=result.baseline_version,
            reason=result.reason,
        )
        if not verdict.decision.promote:
            REJECTED.add(reason=verdict.decision.kind or "rejected")
            return False
        await self._promote(version, verdict.manifest_key, result.reason)
        PROMOTED.add()
        return True

    async def _promote(self, version: int, manifest_key: str, reason: str) -> None:
        await pointer.promote(
            self.evals,
            self.bus,
            run_id=self.run_id,
            version=version,
            manifest_key=manifest_key,
            reason=reason,
            idempotent=True,
        )
        PROMOTED_VERSION.set(float(version))

    async def _resume(self, existing: EvalResult, manifest_key: str) -> str:
        """A redelivered announcement of a judged version: finish its commit, change nothing else."""
        version = existing.policy_version
        SKIPPED.add(reason="already_judged")
        if existing.decision != "promote":
            return "already_judged"
        promoted = await self.evals.promoted()
        if promoted == version:
            # Promoted; the weights.promoted publish may not have happened: repeat it (same msg id).
            await self._promote(version, manifest_key, existing.reason)
            return "already_judged"
        ever = any(p.action == "promote" and p.version == version for p in await self.evals.promotions(_LOG_SCAN))
        if ever or (promoted is not None and version < promoted):
            return "already_judged"  # rolled back or overtaken since: leave the pointer alone
        await self._promote(version, manifest_key, existing.reason)
        PROMOTED.add()
        return "promoted"

    async def restore_pointer(self, last: WeightsPromoted | None) -> int | None:
        """After Redis lost its state: point at the last `weights.promoted` of this run again."""
        current = await self.evals.promoted()
        if current is not None or last is None or (last.run_id and last.run_id != self.run_id):
            return current
        await self.evals.promote(last.policy_version, reason="restored from the last weights.promoted")
        log.warning("promoted pointer restored from weights.promoted", policy_version=last.policy_version)
        return last.policy_version


def _older(decision: Decision, promoted: int) -> Decision:
    return dataclasses.replace(
        decision,
        promote=False,
        kind="older_than_promoted",
        reason=f"older than the promoted version v{promoted} ({decision.reason})",
    )


def _finite(x: float, default: float) -> float:
    # JSON has no NaN: an undefined interval (one task) is sent as the point estimate.
    return x if math.isfinite(x) else default
