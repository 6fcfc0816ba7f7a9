"""The eval-gate service: judges announced weight versions and promotes the ones that pass.

    weights.announce --(durable "eval-gate")--> intake --> gate: evaluator (engine + harness, pinned suite)
                                                            -> decide -> evals/<run>/v<version>/<suite>.json
                                                            -> eval.result, Redis eval history
                                                            -> on promotion: Redis promoted pointer, weights.promoted

`setup` opens the object store, the bus (streams and durables provisioned idempotently) and the
control plane (Redis; not required to answer yet: while it is down the service is ready but
reports `control.redis = "degraded"` and takes no announcements), loads `[model]` into an engine
and pins the suite. If Redis holds no promoted version but the WEIGHTS stream has a
`weights.promoted` of this run (Redis lost its state), the pointer is restored from it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from slipstream.bus import connect_bus
from slipstream.control import Control, ControlClient, ControlUnavailable
from slipstream.eval_gate.config import EvalGateConfig
from slipstream.eval_gate.evaluator import Evaluator, build_evaluator
from slipstream.eval_gate.gate import Gate
from slipstream.eval_gate.intake import AnnounceIntake
from slipstream.runtime.service import BaseService
from slipstream.schemas import WeightAnnounce, WeightsPromoted
from slipstream.schemas.subjects import WEIGHTS_PROMOTED, consumer
from slipstream.store import setup_store
from slipstream.telemetry.logs import get_logger
from slipstream.trust import AnnounceVerifier, Keyring

if TYPE_CHECKING:
    from slipstream.bus import Bus, Consumer
    from slipstream.store import ObjectStore

log = get_logger(__name__)
DURABLE = "eval-gate"
_LAST_PROMOTED_WAIT_S = 1.0


class EvalGateService(BaseService):
    name = "eval-gate"

    def __init__(self, cfg: EvalGateConfig) -> None:
        if not cfg.service.redis_url:
            raise ValueError(
                "eval-gate keeps the eval history and the promoted version in Redis: "
                "set [service] redis_url (SLIPSTREAM_SERVICE__REDIS_URL)"
            )
        self.cfg = cfg
        self.bus: Bus | None = None
        self.store: ObjectStore | None = None
        self.control: Control | None = None
        self.evaluator: Evaluator | None = None
        self.gate: Gate | None = None
        self.consumer: Consumer[WeightAnnounce] | None = None
        self.intake: AnnounceIntake | None = None
        self.verifier: AnnounceVerifier | None = None

    async def setup(self) -> None:
        cfg, g = self.cfg, self.cfg.gate
        run_id = cfg.service.run_id
        keyring = Keyring.parse(cfg.trust.trusted_keys)  # BadKey names the entry: fatal
        self.store = await asyncio.to_thread(setup_store, cfg.store)
        self.control = Control(ControlClient(cfg.service.redis_url, timeout_s=g.control_timeout_s), run_id)
        self.verifier = AnnounceVerifier(
            self.store, run_id=run_id, keyring=keyring, control=self.control, timeout_s=cfg.trust.verify_timeout_s
        )
        self.evaluator = await build_evaluator(cfg.model, g, self.store, run_id, cfg.summary)
        # Candidates and baselines alike load only through manifests signed by a trusted key.
        self.evaluator.check = self.verifier.check_chain_manifest if self.verifier is not None else None
        self.bus = await connect_bus(cfg.bus, name=f"{self.name}/{cfg.service.replica}")
        await self.bus.ensure_streams()
        self.consumer = await self.bus.consumer(DURABLE, WeightAnnounce)
        self.gate = Gate(
            g, run_id=run_id, evaluator=self.evaluator, store=self.store, evals=self.control.evals, bus=self.bus
        )
        _, spec = consumer(DURABLE)
        self.intake = AnnounceIntake(
            self.consumer,
            self.gate,
            self.control,
            batch=cfg.bus.fetch_batch,
            fetch_timeout_s=cfg.bus.fetch_timeout_s,
            retry_delay_s=g.retry_delay_s,
            heartbeat_s=spec.ack_wait_s / 3,
            skip_superseded=g.skip_superseded,
            verifier=self.verifier,
        )
        if await self.control.ping():
            await self._restore_pointer()
        else:
            log.warning("control plane Redis unreachable at start; waiting for it", **self.control.readiness())

    async def _restore_pointer(self) -> None:
        assert self.bus is not None and self.gate is not None
        reader = self.bus.subscribe(WEIGHTS_PROMOTED, WeightsPromoted, deliver="last")
        try:
            last = (await asyncio.wait_for(anext(reader), _LAST_PROMOTED_WAIT_S)).msg
        except (TimeoutError, StopAsyncIteration):
            last = None
        finally:
            with contextlib.suppress(Exception):  # a reader that never opened may complain on close
                await reader.close()
        try:
            await self.gate.restore_pointer(last)
        except ControlUnavailable as exc:
            log.warning("could not check the promoted pointer; Redis went away", error=str(exc))

    async def run(self, stop: asyncio.Event) -> None:
        assert self.intake is not None, "setup() was not run"
        await self.intake.run(stop)
        log.info("intake stopped", **dict(self.intake.outcomes))

    async def close(self) -> None:
        if self.evaluator is not None:
            await self.evaluator.stop()
        if self.consumer is not None:
            with contextlib.suppress(Exception):
                await self.consumer.close()
        if self.bus is not None:
            await self.bus.close()
        if self.control is not None:
            await self.control.close()
        if self.store is not None:
            await asyncio.to_thread(self.store.close)

    def ready(self) -> bool:
        return self.bus is not None and self.bus.connected and self.intake is not None

    def in_flight(self) -> int:
        return self.intake.in_flight if self.intake is not None else 0

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "bus": {"type": self.cfg.bus.type, "connected": self.bus is not None and self.bus.connected}
        }
        if self.control is not None:
            out["control"] = self.control.readiness()
        if self.gate is not None:
            out["suite"] = {
                "name": self.gate.suite.name,
                "tasks": self.gate.suite.size,
                "fingerprint": self.gate.suite.fingerprint,
                "every_n_versions": self.cfg.gate.every_n_versions,
            }
            out["evaluating"] = self.gate.evaluating
            last = self.gate.last
            if last is not None:
                out["last"] = {
                    "policy_version": last.policy_version,
                    "decision": last.decision,
                    "score": round(last.score, 4),
                    "reason": last.reason,
                }
        if self.intake is not None:
            out["announcements"] = dict(self.intake.outcomes)
        if self.verifier is not None:
            out["announces"] = self.verifier.status()
        return out
