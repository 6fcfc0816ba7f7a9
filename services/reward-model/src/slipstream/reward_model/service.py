"""The reward-model service: scores raw episodes with their environment's verifier and passes them on.

    traj.raw.<env> --(durable "reward-model", shared by all replicas)--> score --> traj.scored.<env>

Every replica binds the same durable pull consumer, so N replicas split the backlog. Messages are
`Episode`s (a v1 `Trajectory` arrives upgraded to a one-sample episode). A by-reference episode
(a stub whose body is in the object store) is loaded and verified before scoring, and its scored
copy carries the same stub: the body is never rewritten. A raw episode is acked only after
JetStream acked its scored copy (published with msg_id = episode_id, so a redelivery after a lost
ack is stored once). What can never be scored (unknown environment, bad split, a scored copy too
large for the bus, a body missing from the store or not matching its stub) is dead-lettered to
dlq.TRAJ_RAW with its reason and counted; an unparsable answer is not an error: it is scored as a
failure (reward 0) and counted as a parse failure. An episode with `infra_error` is passed on
unjudged (reward 0, counted) for the learner to drop: never the model's fault.

Rubric judges (`[reward.judges]`, `judging.py`) add a weighted `judge` component to the episodes
of their envs after the verifier; their calls are awaited on this loop (network I/O, bounded by
each judge's limits), so up to `concurrency` episodes are judged at once. An episode the judge
could not score, or one its environment masks (a served episode whose feedback the `serve` reward
spec does not use), is published marked `unscorable` (counted) for the learner to drop.

Provenance: with `[provenance] signing_key`, every scored copy is signed (ed25519, `slipstream.trust`)
right before it is published; a learner with trusted keys trains on nothing else. `status()` names
the key id the learner must list.

Tracing: `consume` runs each episode in a CONSUMER span, child of the worker's publish, so the
scored copy published inside it continues the task's trace; the span carries the reward.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import msgspec

from slipstream.bus import PayloadTooLarge, connect_bus, consume
from slipstream.bus.tracing import annotate
from slipstream.reward_model.config import RewardModelConfig
from slipstream.reward_model.rejection import reject
from slipstream.reward_model.scorer import Scorer, Unscorable
from slipstream.runtime.service import BaseService
from slipstream.schemas import Episode
from slipstream.schemas.subjects import traj_scored_subject
from slipstream.store import ObjectNotFound, ObjectStore, setup_store
from slipstream.store import episodes as episode_bodies
from slipstream.telemetry.logs import get_logger
from slipstream.telemetry.metrics import counter, histogram
from slipstream.trust import SigningKey, load_signing_key, sign_scored

if TYPE_CHECKING:
    from slipstream.bus import Bus, Consumer, Delivery
    from slipstream.reward_model.judging import Judges

DURABLE = "reward-model"
log = get_logger(__name__)

REWARD = histogram(
    "reward/score/reward",
    "Reward of each scored trajectory (label env).",
    buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 1.0, 1.1),
)
SCORED = counter("reward/score/scored", "Trajectories scored and published (label env).")
CORRECT = counter("reward/score/correct", "Scored trajectories the verifier judged correct (label env).")
PARSE_FAILURES = counter("reward/score/parse_failures", "Answers that did not parse, scored as failures (label env).")
DEAD_LETTERED = counter("reward/score/dead_lettered", "Trajectories sent to dlq.TRAJ_RAW (label reason).")
INFRA_ERRORS = counter(
    "reward/score/infra_errors", "Episodes passed on unjudged: an infrastructure failure (label env)."
)
UNSCORABLE = counter(
    "reward/score/unscorable",
    "Episodes published marked unscorable: no usable judge verdict, or masked by the env's reward spec (label env).",
)


class RewardModelService(BaseService):
    name = "reward-model"

    def __init__(self, cfg: RewardModelConfig) -> None:
        self.cfg = cfg
        self.bus: Bus | None = None
        self.consumer: Consumer[Episode] | None = None
        self.scorer: Scorer | None = None
        self.store: ObjectStore | None = None
        self.judges: Judges | None = None
        self.signing_key: SigningKey | None = None
        self._inflight = 0
        self.counts = {"scored": 0, "parse_failures": 0, "dead_lettered": 0, "infra_errors": 0, "unscorable": 0}

    async def setup(self) -> None:
        if self.cfg.provenance.signing_key:
            self.signing_key = load_signing_key(self.cfg.provenance.signing_key)  # BadKey names the file: fatal
            log.info("signing scores", key_id=self.signing_key.key_id, public_key=self.signing_key.public)
        else:
            log.warning("no [provenance] signing_key: scores are not signed; a learner with trusted keys refuses them")
        # Options first: a bad [reward] env_options fails setup before anything is consumed.
        self.scorer = Scorer(self.cfg.reward.env_options)
        # Judges next: a missing rubric file, an unset API key variable or two judges for one env
        # fail setup (exit 1) naming the judge, before anything is consumed.
        self.cfg.reward.check_judges()
        if self.cfg.reward.judges:
            # Imported only when configured: the judge client (openai) doubles this service's start
            # time, and a service still importing when SIGTERM comes dies by the signal (exit -15).
            from slipstream.reward_model.judging import Judges

            self.judges = Judges.from_config(self.cfg.reward.judges, redis_url=self.cfg.service.redis_url)
        self.bus = await connect_bus(self.cfg.bus, name=f"{self.name}/{self.cfg.service.replica}")
        await self.bus.ensure_streams()
        self.store = await asyncio.to_thread(setup_store, self.cfg.store)
        self.consumer = await self.bus.consumer(DURABLE, Episode)

    async def run(self, stop: asyncio.Event) -> None:
        assert self.consumer is not None, "setup() was not run"
        stats = await consume(self.consumer, self._handle, stop=stop, concurrency=self.cfg.reward.concurrency)
        log.info("consume loop stopped", handled=stats.handled, failed=stats.failed, released=stats.released)

    async def _handle(self, d: Delivery[Episode]) -> None:
        assert self.bus is not None and self.scorer is not None and self.consumer is not None
        assert self.store is not None
        sent = d.msg
        self._inflight += 1
        try:
            try:
                full = await asyncio.to_thread(episode_bodies.load, self.store, sent)
                # In a thread: a grader may run tests in a sandbox for seconds (`code`), and the
                # loop must keep answering probes, heartbeats and the other deliveries meanwhile.
                scored, score = await asyncio.to_thread(self.scorer.score, full, now=time.time())
                if self.judges is not None:
                    scored = await self.judges.apply(scored, full)
                # The scored copy carries what came in (a stub stays a stub); a body that grew past
                # the limit with its score goes to the store now.
                small = await asyncio.to_thread(episode_bodies.offload, self.store, sent, self.bus.max_payload)
                scored = msgspec.structs.replace(scored, episode=small)
                if self.signing_key is not None:
                    scored = sign_scored(scored, self.signing_key)
                await self.bus.publish(traj_scored_subject(sent.env), scored, msg_id=sent.episode_id)
            except Unscorable as exc:
                await self._reject(d, exc.kind, str(exc))
                return
            except (ObjectNotFound, episode_bodies.EpisodeBodyError) as exc:
                await self._reject(d, "bad_body", str(exc))
                return
            except PayloadTooLarge as exc:
                await self._reject(d, "too_large", str(exc))
                return
        finally:
            self._inflight -= 1
        annotate({"slipstream.reward": scored.reward, "slipstream.correct": scored.correct})
        # Counted after the publish was acked: a redelivered message that failed before is counted once.
        env = sent.env
        if full.infra_error:
            INFRA_ERRORS.add(1, env=env)
            self.counts["infra_errors"] += 1
            return
        if scored.unscorable:
            UNSCORABLE.add(1, env=env)
            self.counts["unscorable"] += 1
            log.info("published unscorable", episode_id=sent.episode_id, reason=scored.unscorable[:300])
            return
        REWARD.observe(scored.reward, env=env)
        SCORED.add(1, env=env)
        self.counts["scored"] += 1
        if scored.correct:
            CORRECT.add(1, env=env)
        if not score.parse_ok:
            PARSE_FAILURES.add(1, env=env)
            self.counts["parse_failures"] += 1
            log.debug("unparsable answer", episode_id=sent.episode_id, reason=score.reason)

    async def _reject(self, d: Delivery[Episode], kind: str, detail: str) -> None:
        assert self.bus is not None and self.consumer is not None
        await reject(self.bus, d, reason=f"{kind}: {detail}", stream=self.consumer.stream, consumer=DURABLE)
        DEAD_LETTERED.add(1, reason=kind)
        self.counts["dead_lettered"] += 1
        log.warning("dead-lettered", episode_id=d.msg.episode_id, kind=kind, detail=detail)

    async def close(self) -> None:
        if self.judges is not None:
            await self.judges.close()
        if self.bus is not None:
            await self.bus.close()
        if self.store is not None:
            self.store.close()

    def ready(self) -> bool:
        return self.bus is not None and self.bus.connected

    def in_flight(self) -> int:
        return self._inflight

    def status(self) -> dict[str, Any]:
        return {
            "bus": {"type": self.cfg.bus.type, "connected": self.bus is not None and self.bus.connected},
            "inflight": self._inflight,
            "signing_key": self.signing_key.key_id if self.signing_key is not None else "",
            **self.counts,
            **({"judges": self.judges.status()} if self.judges is not None and self.judges.judges else {}),
            **({"judge_cache": cache} if self.judges is not None and (cache := self.judges.cache_status()) else {}),
        }
