"""The rollout-worker service: wires the source, the work, the sink and the weight watcher.

    intake (tasks.>, shared durable) -> pipeline: sampler (engine + env harness) -> outbox (traj.raw.<env>)
    follower (weights.announce) -> engine.apply_weights, between two decode steps

`setup` loads the model ([model]) into a TorchEngine (or, with `[engine] type = "http"`, connects
an HttpEngine to a dedicated inference server and loads only the tokenizer), connects the bus and the object store and
binds the `rollout-worker` durable; with `[tools] transport = "nats"` it also connects to the
tool-service's NATS, and every episode's tool calls go there (libs/toolcalls remote.py). `run`
takes tasks until SIGTERM; then it stops fetching, gives in-flight groups the drain budget
(less a grace period) to finish and be published and acked, and hands back (releases) the rest.
Everything the loops do is in their own modules.

With `[endpoint] enabled` the worker also opens the OpenAI-compatible endpoint (`slipstream.serve`)
over the same engine: calls share the engine's batch with the tasks, every call is recorded, and
each session is stored as an episode in the object store when it goes idle or at shutdown. The
episode then waits in the pending stage for its feedback (in Redis with `[service] redis_url`, so
feedback posted to any replica reaches it; else in this process) and is published with it, in
groups, to `traj.raw.<[endpoint] env>`. With `[endpoint] max_version_lag` the follower also notes
announced versions, and the endpoint answers 429 while the served version lags them too far.

Frozen sub-agents (`spawn(..., trainable=False)`) run, with `[subagents] transport = "local"`
(default), on a second engine in this process over a deep copy of the weights taken before any
announcement, built on first use (libs/engine frozen.py), or version `[subagents] pin_version` from
the store; the follower never touches it. With `[engine] type = "http"` (or "vllm") that copy is [model] loaded
here as well (the server's weights are live), and setup fails if it cannot be loaded. With `"nats"`
they are requests to the sub-agent pool (subagent_client.py), and a reply played on another version
than `[subagents] pin_version` (-1 = 0) is rejected as an infra error. With
`[pool] subagents = true` the worker *is* a pool replica: it binds the `subagent-pool` durable
instead of `rollout-worker`, loads exactly `[pool] pin_version`, notes but never applies
announcements, and answers each request's inbox (subagent_pool.py).

Every announce is verified first (`[trust]`, and with `[service] redis_url` the granted fencing
token). `/readyz` fails, with the reason in its status, when tasks are held or a newer version is
known and neither a rollout nor a version has gone through for `[service] stall_after_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from typing import TYPE_CHECKING, Any

from slipstream.bus import connect_bus
from slipstream.control import Control, ControlClient
from slipstream.engine.engine import TorchEngine
from slipstream.engine.frozen import FrozenEngine
from slipstream.engine.interface import Engine
from slipstream.engine.source import load_model, load_tokenizer_only, resolve_device, torch_dtype
from slipstream.engine.tokenizer import Tokenizer
from slipstream.envs.registry import close_envs
from slipstream.rollout_worker.config import RolloutWorkerConfig
from slipstream.rollout_worker.follower import WeightFollower
from slipstream.rollout_worker.instruments import sample_gauges
from slipstream.rollout_worker.intake import TaskIntake
from slipstream.rollout_worker.outbox import Outbox
from slipstream.rollout_worker.pipeline import TaskPipeline
from slipstream.rollout_worker.sampler import Sampler, check_env_options, check_summary
from slipstream.rollout_worker.screen import TaskScreen
from slipstream.rollout_worker.subagent_client import NatsSubagents
from slipstream.rollout_worker.subagent_pool import SubagentServer
from slipstream.runtime.progress import ProgressWatch
from slipstream.runtime.service import BaseService
from slipstream.schemas import SubagentRequest, Task
from slipstream.schemas.subjects import SUBAGENT_POOL_DURABLE
from slipstream.schemas.subjects import consumer as durable_spec
from slipstream.serve import MemoryPending, RedisPending, ServeEndpoint, StoreSink, pending_policy
from slipstream.store import setup_store
from slipstream.telemetry.logs import get_logger
from slipstream.toolcalls import ToolRegistry, ToolTransport
from slipstream.trust import AnnounceVerifier, Keyring

if TYPE_CHECKING:
    from nats.aio.client import Client

    from slipstream.bus import Bus, Consumer
    from slipstream.store import ObjectStore

log = get_logger(__name__)
DURABLE = "rollout-worker"


class RolloutWorkerService(BaseService):
    name = "rollout-worker"

    def __init__(self, cfg: RolloutWorkerConfig) -> None:
        self.cfg = cfg
        self.worker_id = f"{self.name}/{cfg.service.replica or 'local'}"
        self.bus: Bus | None = None
        self.store: ObjectStore | None = None
        self.engine: Engine | None = None
        self.consumer: Consumer[Task] | None = None
        self.intake: TaskIntake | None = None
        self.follower: WeightFollower | None = None
        self.pipeline: TaskPipeline | None = None
        self.outbox: Outbox | None = None
        self.tools_nc: Client | None = None
        self.tool_stats: dict[str, int] = {}
        self.control: Control | None = None
        self.verifier: AnnounceVerifier | None = None
        self.progress = ProgressWatch(cfg.service.stall_after_s)
        self.endpoint: ServeEndpoint | None = None
        self.frozen_engine: Engine | None = None
        self.subagents: NatsSubagents | None = None
        self.pool: SubagentServer | None = None
        self._model: Any = None  # the torch model as loaded, before any version (the frozen copy's source)

    @property
    def pooled(self) -> bool:
        """A sub-agent pool replica (`[pool] subagents`), not a task worker."""
        return self.cfg.pool.subagents

    def tools_url(self) -> str:
        """Where the tool-service is: `[tools] url`, else the bus's NATS."""
        t = self.cfg.tools
        if t.url:
            return t.url
        if self.cfg.bus.type != "nats":
            raise ValueError("[tools] transport = 'nats' needs [tools] url when [bus] type is not 'nats'")
        return self.cfg.bus.url

    async def _connect_tools(self) -> None:
        from slipstream.toolcalls.remote import connect

        self.tools_nc = await connect(
            self.tools_url(),
            name=self.worker_id,
            timeout_s=self.cfg.tools.connect_timeout_s,
            options=self.cfg.bus.nats_options(),  # the worker's own user may send tool calls
        )

    def _remote_tools(self, registry: ToolRegistry) -> ToolTransport:
        from slipstream.toolcalls.remote import NatsTransport

        assert self.tools_nc is not None, "setup() did not connect the tool transport"
        # One per episode: a cheap view of the one connection, counting into the worker's stats.
        return NatsTransport.from_config(
            self.tools_nc, registry, self.cfg.tools, caller=self.worker_id, stats=self.tool_stats
        )

    async def _build_engine(self) -> tuple[Engine, Tokenizer]:
        """The `[engine]` engine, started: TorchEngine over `[model]`, or HttpEngine to a server."""
        cfg = self.cfg
        if cfg.engine.type == "http":
            from slipstream.serve.http_engine import HttpEngine

            tokenizer = await asyncio.to_thread(load_tokenizer_only, cfg.model)
            remote = HttpEngine.from_config(cfg.engine)
            await remote.start()
            embed = remote.param_specs().get("model.embed_tokens.weight")
            if embed is not None and tokenizer.vocab_size > embed.shape[0]:
                await remote.stop()
                raise ValueError(
                    f"[model] tokenizer has {tokenizer.vocab_size} ids but the server at {cfg.engine.url} embeds "
                    f"{embed.shape[0]}: [model] must name the model the server serves"
                )
            log.info("driving a remote inference server", url=cfg.engine.url, policy_version=remote.policy_version)
            if cfg.subagents.transport == "local" and not self.pooled:
                # The server's weights follow every announcement: frozen sub-agents need weights of their
                # own, so [model] is loaded here too (the copy only: its engine is built on first use).
                try:
                    self._model, _ = await asyncio.to_thread(load_model, cfg.model)
                except Exception as exc:
                    await remote.stop()
                    raise ValueError(
                        f"[engine] type = 'http' with [subagents] transport = 'local' needs a frozen copy of [model] "
                        f"in this worker (the server at {cfg.engine.url} serves the live weights), and [model] "
                        f"could not be loaded: {exc}; load it, or set [subagents] transport = 'nats' (the pinned pool)"
                    ) from exc
            return remote, tokenizer
        if cfg.engine.type == "vllm":
            return await self._vllm_engine()
        model, tokenizer = await asyncio.to_thread(load_model, cfg.model)
        if cfg.subagents.transport == "local" and not self.pooled:
            # Copied before the engine holds it: the frozen engine's weights are never the live ones.
            self._model = await asyncio.to_thread(copy.deepcopy, model)
        engine = self._torch_engine(model, tokenizer)
        await engine.start()
        return engine, tokenizer

    async def _vllm_engine(self) -> tuple[Engine, Tokenizer]:
        """A vLLM server of this worker's own over [model] (as an HF directory), started and stopped here."""
        from slipstream.engine.vllm_engine import VllmEngine
        from slipstream.engine.vllm_setup import model_dir_for

        cfg = self.cfg
        directory = await asyncio.to_thread(model_dir_for, cfg.model)
        tokenizer = await asyncio.to_thread(load_tokenizer_only, cfg.model)
        if cfg.subagents.transport == "local" and not self.pooled:
            # The server's weights follow every announcement: frozen sub-agents get [model]'s own copy.
            self._model, _ = await asyncio.to_thread(load_model, cfg.model)
        m = cfg.model
        engine = VllmEngine.from_config(
            cfg.engine,
            directory,
            dtype=m.dtype,
            lora_rank=m.lora_rank,
            lora_alpha=m.lora_alpha,
            lora_targets=m.lora_targets,
        )
        await engine.start()
        log.info("started vLLM", url=engine.url, start_s=round(engine.stats()["start_s"], 1), log=str(engine.log_path))
        return engine, tokenizer

    def _torch_engine(self, model: Any, tokenizer: Tokenizer) -> TorchEngine:
        cfg, w = self.cfg, self.cfg.worker
        return TorchEngine(
            model,
            tokenizer,
            max_batch=w.max_batch,
            max_seq_len=w.max_seq_len or None,
            device=resolve_device(cfg.model),
            dtype=torch_dtype(cfg.model),
            seed=cfg.model.seed,
            policy_version=0,
            recompute_kv_on_update=w.recompute_kv_on_update,
            speculative_tokens=w.speculative_tokens,
            # A LoRA run's versions are its adapters only; the frozen base stays as loaded.
            allow_partial_updates=cfg.model.lora_rank > 0,
        )

    async def _build_frozen(self, tokenizer: Tokenizer) -> None:
        """`[subagents] transport = "local"`: the engine over the weights copied at load time.

        At its first version (pin_version -1) the engine is built by the first sub-agent call
        (frozen.py: no second KV cache for envs that never spawn); pinned to a stored version it
        is built now and that version loaded into it, once.
        """
        model, self._model = self._model, None
        if model is None:  # _build_engine keeps a copy for every engine type; never run on the live weights
            raise RuntimeError("no frozen copy of [model] was kept: frozen sub-agents would run on the live weights")
        pin = self.cfg.subagents.pin_version
        if pin <= 0:
            self.frozen_engine = FrozenEngine(model, lambda m: self._torch_engine(m, tokenizer))
            return
        frozen = self._torch_engine(model, tokenizer)
        await frozen.start()
        self.frozen_engine = frozen
        assert self.bus is not None and self.store is not None
        loader = WeightFollower(
            self.bus,
            self.store,
            frozen,
            run_id=self.cfg.service.run_id,
            retries=self.cfg.worker.weight_fetch_retries,
            backoff_s=self.cfg.worker.weight_fetch_backoff_s,
            worker_id=f"{self.worker_id}/frozen",
            verifier=self.verifier,
            pinned=True,
        )
        await loader.load_pinned(pin, wait_s=self.cfg.pool.pin_wait_s)
        log.info("frozen sub-agent engine ready", policy_version=frozen.policy_version)

    async def setup(self) -> None:
        cfg, w = self.cfg, self.cfg.worker
        check_env_options(w.env_options)
        if cfg.tools.transport == "nats":
            self.tools_url()  # a missing url fails before the model is loaded
        keyring = Keyring.parse(cfg.trust.trusted_keys)  # BadKey names the entry: fatal before the model loads
        ack_wait_s = durable_spec(DURABLE)[1].ack_wait_s
        if w.heartbeat_s * 2 > ack_wait_s:
            # A missed beat or two must not let the server hand a live worker's task to another one.
            raise ValueError(
                f"worker.heartbeat_s = {w.heartbeat_s} s is more than half the {DURABLE!r} durable's "
                f"ack_wait ({ack_wait_s} s); held tasks would be redelivered while still running"
            )
        check_summary(
            cfg.summary, w.max_seq_len, w.max_tokens
        )  # before the model loads: a threshold past the context is fatal
        self.engine, tokenizer = await self._build_engine()
        self.store = await asyncio.to_thread(setup_store, cfg.store)
        self.bus = await connect_bus(cfg.bus, name=f"{self.name}/{cfg.service.replica}")
        await self.bus.ensure_streams()
        if self.pooled:
            await self._setup_pool(keyring, tokenizer)
            return
        self.consumer = await self.bus.consumer(DURABLE, Task)
        run_id = cfg.service.run_id
        self.follower = self._follower(
            keyring, mode=w.follow, track_announced=cfg.endpoint.enabled and cfg.endpoint.max_version_lag > 0
        )
        tools = None
        if cfg.tools.transport == "nats":
            await self._connect_tools()
            tools = self._remote_tools
        if cfg.subagents.transport == "nats":
            sc = cfg.subagents
            self.subagents = NatsSubagents(
                self.bus,
                timeout_s=sc.timeout_s,
                retries=sc.retries,
                retry_backoff_s=sc.retry_backoff_s,
                caller=self.worker_id,
                pin_version=max(0, sc.pin_version),  # -1: [model]'s weights, version 0 (the pool's default pin)
            )
        else:
            await self._build_frozen(tokenizer)
        sampler = Sampler(
            self.engine,
            tokenizer,
            w,
            worker_id=self.worker_id,
            run_id=run_id,
            tools=tools,
            summary=cfg.summary,
            frozen_engine=self.frozen_engine,
            subagents=self.subagents,
        )
        self.outbox = Outbox(self.bus, self.store)
        self.pipeline = TaskPipeline(
            self.bus,
            sampler,
            self.outbox,
            self.follower,
            version_wait_timeout_s=w.version_wait_timeout_s,
            retry_delay_s=w.retry_delay_s,
            screen=self._screen(tokenizer),
        )
        self.intake = TaskIntake(
            self.consumer,
            max_in_flight=w.max_tasks_in_flight,
            heartbeat_s=w.heartbeat_s,
            fetch_timeout_s=cfg.bus.fetch_timeout_s,
            error_delay_s=w.retry_delay_s,
        )
        if cfg.endpoint.enabled:
            await self._open_endpoint(tokenizer)

    def _screen(self, tokenizer: Tokenizer) -> TaskScreen | None:
        """The task screen of `[worker] screen_target` (screen.py), or None when it is 0."""
        w = self.cfg.worker
        if w.screen_target <= 0:
            return None
        if not isinstance(self.engine, TorchEngine):
            raise ValueError(
                f"[worker] screen_target = {w.screen_target} needs the torch engine (it reads the model's "
                f"log-probs in this process); [engine] type is {self.cfg.engine.type!r}"
            )
        return TaskScreen(self.engine.model, tokenizer, target=w.screen_target, temperature=w.temperature)

    def _follower(self, keyring: Keyring, **options: Any) -> WeightFollower:
        """The announce verifier (and its fencing check) and the weight follower; `options`: the follower's
        mode (task workers) or `pinned` (pool replicas)."""
        cfg, w = self.cfg, self.cfg.worker
        assert self.bus is not None and self.store is not None and self.engine is not None
        run_id = cfg.service.run_id
        if cfg.service.redis_url:
            # Only to compare announced fencing tokens with the granted ones; no ping: Redis away = unchecked.
            self.control = Control(ControlClient(cfg.service.redis_url), run_id)
        self.verifier = AnnounceVerifier(
            self.store, run_id=run_id, keyring=keyring, control=self.control, timeout_s=cfg.trust.verify_timeout_s
        )
        return WeightFollower(
            self.bus,
            self.store,
            self.engine,
            run_id=run_id,
            retries=w.weight_fetch_retries,
            backoff_s=w.weight_fetch_backoff_s,
            apply_timeout_s=w.weight_apply_timeout_s,
            digest=w.weights_digest,
            worker_id=self.worker_id,
            verifier=self.verifier,
            **options,
        )

    async def _setup_pool(self, keyring: Keyring, tokenizer: Tokenizer) -> None:
        """A pool replica: the `subagent-pool` durable, the pinned version, the request handler."""
        cfg = self.cfg
        assert self.bus is not None and self.store is not None and self.engine is not None
        nc = getattr(self.bus, "nc", None)
        if nc is None:
            raise ValueError("[pool] subagents = true needs [bus] type = 'nats' (replies go to requesters' inboxes)")
        self.follower = self._follower(keyring, pinned=True)
        await self.follower.load_pinned(cfg.pool.pin_version, wait_s=cfg.pool.pin_wait_s)
        if cfg.worker.weights_digest and not self.follower.weights_digest:
            from slipstream.rollout_worker.follower import engine_digest

            self.follower.weights_digest = await asyncio.to_thread(engine_digest, self.engine)
        tools = None
        if cfg.tools.transport == "nats":
            await self._connect_tools()
            tools = self._remote_tools
        self.pool = SubagentServer(
            nc,
            self.engine,
            tokenizer,
            worker_id=self.worker_id,
            tools=tools,
            replay_cache=cfg.pool.replay_cache,
        )
        self.consumer = await self.bus.consumer(SUBAGENT_POOL_DURABLE, SubagentRequest)  # type: ignore[arg-type]
        self.intake = TaskIntake(
            self.consumer,
            max_in_flight=cfg.pool.max_in_flight,
            heartbeat_s=cfg.worker.heartbeat_s,
            fetch_timeout_s=cfg.bus.fetch_timeout_s,
            error_delay_s=cfg.worker.retry_delay_s,
        )
        log.info("sub-agent pool replica ready", policy_version=self.engine.policy_version, worker_id=self.worker_id)

    def served_model_name(self) -> str:
        m = self.cfg.model
        base = m.name or (m.path.rstrip("/").rsplit("/", 1)[-1] if m.path else m.preset)
        return f"slipstream-{base}"

    async def _open_endpoint(self, tokenizer: Any) -> None:
        assert self.engine is not None and self.store is not None and self.bus is not None
        assert self.follower is not None
        run_id = self.cfg.service.run_id
        policy = pending_policy(self.cfg.endpoint, run_id)
        redis_url = self.cfg.service.redis_url
        pending = RedisPending.connect(policy, redis_url) if redis_url else MemoryPending(policy)
        self.endpoint = ServeEndpoint(
            self.engine,
            tokenizer,
            self.cfg.endpoint,
            StoreSink(self.store, run_id),
            model_name=self.served_model_name(),
            run_id=run_id,
            worker_id=self.worker_id,
            pending=pending,
            store=self.store,
            bus=self.bus,
            newest_version=self.follower.newest_version,
        )
        port = await self.endpoint.start()
        log.info("serving endpoint open", url=self.endpoint.base_url, model=self.endpoint.model_name, port=port)

    async def run(self, stop: asyncio.Event) -> None:
        if self.pool is not None:
            # A pool replica: sub-agent requests in, replies out; its pinned follower only notes announces.
            await self._serve(stop, self.pool, "pool", abort=None)
            return
        assert self.pipeline
        await self._serve(stop, self.pipeline, "worker", abort=self.pipeline.abort)

    async def _serve(
        self, stop: asyncio.Event, handler: TaskPipeline | SubagentServer, name: str, abort: asyncio.Event | None
    ) -> None:
        """Follow versions and feed the intake's messages to `handler` until `stop` or a failure, then drain.

        With `abort` (task rollouts) the drain keeps a grace period in which unfinished work is
        aborted and handed back; a pool replica's sub-agents just get the whole budget.
        """
        assert self.engine and self.intake and self.follower
        intake = self.intake
        quit_follow = asyncio.Event()
        follow = asyncio.create_task(self.follower.run(quit_follow), name=f"{name}.follow")
        gauges = asyncio.create_task(sample_gauges(self.engine, lambda: intake.in_flight, quit_follow))
        fetch_stop = asyncio.Event()
        fetch = asyncio.create_task(intake.run(handler.handle, fetch_stop), name=f"{name}.intake")
        stopped = asyncio.create_task(stop.wait())
        failed = asyncio.create_task(handler.failed.wait())
        try:
            done, _ = await asyncio.wait({stopped, failed, follow, fetch}, return_when=asyncio.FIRST_COMPLETED)
            fetch_stop.set()
            await fetch
            if follow in done:
                follow.result()  # the watcher ended on its own: raise why
            budget = self.cfg.service.drain_timeout_s
            if abort is None:
                if not await intake.wait_idle(budget):
                    log.warning("drain budget spent with sub-agents still playing", in_flight=intake.in_flight)
            else:
                grace = min(3.0, budget / 4)
                if not await intake.wait_idle(budget - grace):
                    log.warning("drain budget spent; handing back unfinished tasks", in_flight=intake.in_flight)
                    abort.set()
                    await intake.wait_idle(grace)
            if handler.fatal is not None:
                raise handler.fatal
        finally:
            fetch_stop.set()
            quit_follow.set()
            for job in (stopped, failed):
                job.cancel()
            await asyncio.gather(fetch, follow, gauges, stopped, failed, return_exceptions=True)

    async def close(self) -> None:
        # What environments keep open for the process (the verifiers runner and its tool servers).
        await close_envs()
        if self.endpoint is not None:
            # Before the engine stops (in-flight calls finish) and the store closes (sessions flush into it).
            await self.endpoint.close()
        if self.engine is not None:
            await self.engine.stop()
        if self.frozen_engine is not None:
            await self.frozen_engine.stop()
        if self.consumer is not None:
            with contextlib.suppress(Exception):
                await self.consumer.close()
        if self.bus is not None:
            await self.bus.close()
        if self.tools_nc is not None and not self.tools_nc.is_closed:
            await self.tools_nc.close()
        if self.control is not None:
            await self.control.close()
        if self.store is not None:
            await asyncio.to_thread(self.store.close)

    def ready(self) -> bool:
        if self.pool is not None:
            return self.bus is not None and self.bus.connected and self.engine is not None and self.pool.fatal is None
        return (
            self.bus is not None
            and self.bus.connected
            and self.engine is not None
            and self.pipeline is not None
            and self.pipeline.fatal is None
            and self._stall() is None
        )

    def _stall(self) -> str | None:
        """Why this worker cannot advance (see ProgressWatch), or None."""
        if self.intake is None or self.pipeline is None or self.follower is None or self.engine is None:
            return None
        pending = None
        target = self.follower.status()["pending_version"]
        if self.intake.in_flight:
            pending = f"{self.intake.in_flight} task(s) held"
        elif target is not None:
            pending = f"version {target} announced, engine at {self.engine.policy_version}"
        mark = (self.pipeline.outcomes["acked"], self.engine.policy_version)
        return self.progress.observe(mark, pending)

    def in_flight(self) -> int:
        return self.intake.in_flight if self.intake is not None else 0

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "bus": {"type": self.cfg.bus.type, "connected": self.bus is not None and self.bus.connected}
        }
        if self.engine is not None:
            stats = self.engine.stats()
            out["engine"] = {
                "policy_version": self.engine.policy_version,
                "tokens_per_s": round(stats.get("tokens_per_s", 0.0), 1),
                "running": int(stats.get("running", 0)),
                "waiting": int(stats.get("waiting", 0)),
                "tokens_generated": int(stats.get("tokens_generated", 0)),
            }
            out["policy_version"] = self.engine.policy_version
        if self.intake is not None and self.pipeline is not None:
            out["tasks"] = {"inflight": self.intake.in_flight, "taken": self.intake.taken, **self.pipeline.outcomes}
            if self.pipeline.screen is not None:
                out["screen"] = self.pipeline.screen.status()
            out["inflight"] = self.intake.in_flight
        if self.outbox is not None:
            out["trajectories_published"] = self.outbox.published
        if self.follower is not None:
            out["weights"] = self.follower.status()
        if self.cfg.tools.transport == "nats":
            out["tools"] = {
                "transport": "nats",
                "connected": self.tools_nc is not None and self.tools_nc.is_connected,
                **self.tool_stats,
            }
        if self.endpoint is not None:
            out["serve"] = self.endpoint.status()
        if self.pool is not None:
            out["pool"] = self.pool.status()
            if self.intake is not None:
                out["inflight"] = self.intake.in_flight
        else:
            sub: dict[str, Any] = {"transport": self.cfg.subagents.transport}
            if self.frozen_engine is not None:
                sub["frozen_version"] = self.frozen_engine.policy_version
                sub["frozen_started"] = getattr(self.frozen_engine, "started", True)
            if self.subagents is not None:
                sub.update(self.subagents.stats)
            out["subagents"] = sub
        self._stall()
        out["progress"] = self.progress.status()
        return out
