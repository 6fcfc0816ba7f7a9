"""`VllmEngine`: the Engine protocol on a vLLM server this process starts, drives and stops.

`[engine] type = "vllm"`. vLLM pins its own torch and transformers, so it runs from a venv of its
own (`make vllm-venv`, `[engine] vllm_python`) as a subprocess in a new process group on a free
loopback port, serving a Hugging Face model directory (the tiny byte-level model is one: it saves as
a Llama checkpoint with a byte-level tokenizer.json). Everything else goes over its HTTP API:

- `generate` streams `POST /v1/completions` with the prompt as token ids, `return_token_ids` and
  `logprobs: 0`, so every chunk carries the sampled ids and their log-probs. The server runs with
  `--logprobs-mode processed_logprobs`: log-probs of the distribution sampled from (after
  temperature and top-k/top-p), as TorchEngine reports them. Streaming is what lets `stop()` return
  the tokens sampled so far with finish_reason 'abort' (closing the stream aborts it in vLLM).
- `apply_weights` checks names, shapes and dtypes against the checkpoint's tensors (the same checks
  and messages as TorchEngine) and queues the version. One updater applies versions in order:
  it stops sending new requests (they wait here), waits until every request of this engine has
  finished, then `POST /pause?mode=wait`, `POST /collective_rpc` -> `slipstream_load` (the worker
  extension in vllm_ext/, reading a safetensors file written here), `POST /reset_prefix_cache` (no
  block computed by old weights is reused), `POST /resume`, and only then moves `policy_version`.
- What that guarantees: a request runs wholly on one version, the one `policy_version` had when it
  was sent, so its `segments` are `[(version, n)]` and exact. vLLM's `pause(mode="keep")` would
  freeze requests mid-decode, but its HTTP API does not say how many tokens each had by then, so a
  split could not be recorded honestly; updates wait for requests in flight instead (a long request
  delays the next version by its remaining decode time).
- Sessions: vLLM keeps no per-session cache; its automatic prefix caching reuses any earlier
  prompt's blocks, so a later turn prefills only its new tokens without a session. `release` has
  nothing to drop.
- `state_dict` / `named_parameters` are the checkpoint's tensors overlaid with every version
  applied since (what was loaded into vLLM, under HF names; not read back from the server).

Deltas are decoded by the caller (the weight follower verifies the signed manifest and decodes a
delta onto its exact base), so every version arrives here as tensors and is loaded as such.

LoRA (`lora_rank` > 0, a run whose `[model]` trains adapters): a version is the adapters only
(`…q_proj.lora_A` [rank, in], `…lora_B` [out, rank]), which vLLM's full-weight path cannot take. This
engine keeps the checkpoint's base weights and the newest adapters, merges `W + (alpha / rank) · B A`
in float32 for every adapted module (`lora.merge_adapters`), and loads the checkpoint with those merged
weights in place through the same full update as any version (vLLM's own LoRA serving needs
`--enable-lora`, adapter directories and a request-side adapter name: not used).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream.engine.driver import EngineError
from slipstream.engine.interface import GenerationRequest, GenerationResult, ParamSpec, Timings
from slipstream.engine.vllm_setup import checkpoint_specs, find_python, free_port, terminate_group

if TYPE_CHECKING:
    import aiohttp
    from torch import Tensor, nn

    from slipstream.engine.backend import EngineBackend

log = logging.getLogger(__name__)

EXTENSION_DIR = Path(__file__).resolve().parent / "vllm_ext"
EXTENSION_CLS = "slipstream_vllm_ext.WeightLoader"
SERVED_NAME = "slipstream"
# Idle keep-alive connections: this client drops its own before the server would close them (uvicorn's
# default, VLLM_HTTP_TIMEOUT_KEEP_ALIVE, is 5 s, aiohttp's 15 s). The other way round, a request sent on a
# connection the server had just closed failed with "Server disconnected" (seen after a weight update,
# while requests waited: a default-demo run's worker died of it).
CLIENT_KEEPALIVE_S = 30.0
SERVER_KEEPALIVE_S = 120


class VllmEngineError(EngineError):
    """The vLLM server would not start, died, timed out or failed; the message says which and where."""


class VllmEngine:
    """The Engine protocol on a vLLM server started from `python` over the HF directory `model_dir`."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        python: str | Path = ".venv-vllm/bin/python",
        dtype: str = "float32",
        max_model_len: int = 2048,
        kv_cache_gb: int = 1,
        enforce_eager: bool = True,
        threads: int = 0,
        extra_args: Sequence[str] = (),
        start_timeout_s: float = 600.0,
        request_timeout_s: float = 600.0,
        weights_timeout_s: float = 300.0,
        log_path: str | Path | None = None,
        allow_partial_updates: bool = False,
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        lora_targets: Sequence[str] = (),
    ) -> None:
        self.model_dir = Path(model_dir)
        self.python = find_python(Path(python))
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.kv_cache_gb = kv_cache_gb
        self.enforce_eager = enforce_eager
        self.threads = threads
        self.extra_args = list(extra_args)
        self.start_timeout_s = start_timeout_s
        self.request_timeout_s = request_timeout_s
        self.weights_timeout_s = weights_timeout_s
        self.log_path = Path(log_path) if log_path else None
        self.partial = allow_partial_updates
        self.lora_rank = lora_rank
        self.lora_scale = lora_alpha / lora_rank if lora_rank else 0.0
        self.lora_targets = tuple(lora_targets)
        self._adapter_specs: dict[str, ParamSpec] = {}  # LoRA: adapter name -> shape (any float dtype)
        self._adapters: dict[str, Tensor] = {}  # LoRA: the newest adapters received
        self._base: dict[str, Tensor] | None = None  # LoRA: the checkpoint's tensors, read at the first version
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None
        self._session: aiohttp.ClientSession | None = None
        self._specs: dict[str, ParamSpec] = {}
        self._aliases: dict[str, str] = {}
        self._applied: dict[str, Tensor] = {}
        self._version = 0
        self._open = asyncio.Event()  # cleared while an update waits for, or runs after, the in-flight requests
        self._idle = asyncio.Event()  # set while nothing of this engine is in flight
        self._streams: dict[str, asyncio.Task[None]] = {}
        self._updates: asyncio.Queue[tuple[int, dict[str, Tensor], dict[str, Tensor]]] | None = None
        self._updater: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._closing = False
        self._stats: dict[str, float] = {
            "requests": 0.0,
            "requests_aborted": 0.0,
            "tokens_generated": 0.0,
            "weight_updates": 0.0,
            "weight_update_failures": 0.0,
            "last_weight_apply_ms": 0.0,
            "update_wait_ms": 0.0,
            "last_lora_merge_ms": 0.0,
            "start_s": 0.0,
        }
        self.last_update_error = ""

    @classmethod
    def from_config(
        cls,
        cfg: EngineBackend,
        model_dir: str | Path,
        *,
        dtype: str = "float32",
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        lora_targets: Sequence[str] = (),
    ) -> VllmEngine:
        """`lora_*`: `[model]`'s LoRA settings (versions are then adapters, merged here; see the module doc)."""
        if cfg.type != "vllm":
            raise ValueError(f"VllmEngine needs [engine] type = 'vllm', got {cfg.type!r}")
        return cls(
            model_dir,
            dtype=dtype,
            python=cfg.vllm_python,
            max_model_len=cfg.vllm_max_model_len,
            kv_cache_gb=cfg.vllm_kv_cache_gb,
            enforce_eager=cfg.vllm_enforce_eager,
            threads=cfg.vllm_threads,
            extra_args=cfg.vllm_args,
            start_timeout_s=cfg.vllm_start_timeout_s,
            request_timeout_s=cfg.request_timeout_s,
            weights_timeout_s=cfg.weights_timeout_s,
            lora_rank=lora_rank,
            lora_alpha=lora_alpha,
            lora_targets=lora_targets,
        )

    # ----------------------------------------------------------------- protocol: state
    @property
    def policy_version(self) -> int:
        """The version the next request sent will run on (moves once vLLM holds it)."""
        return self._version

    def param_specs(self) -> Mapping[str, ParamSpec]:
        return dict(self._specs)

    def stats(self) -> dict[str, float]:
        return {**self._stats, "policy_version": float(self._version), "vllm_in_flight": float(len(self._streams))}

    # ----------------------------------------------------------------- lifecycle
    def command(self, port: int) -> list[str]:
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir)]
        cmd += ["--served-model-name", SERVED_NAME, "--dtype", self.dtype, "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--worker-extension-cls", EXTENSION_CLS, "--logprobs-mode", "processed_logprobs", "--max-logprobs", "1"]
        # Whole prompts only (--no-enable-chunked-prefill): for a prompt prefilled in parts vLLM discards the
        # token sampled at the partial step and rewinds a seeded request's generator (`gen.set_offset`), which
        # torch's CPU generator does not have ("CPU Generator does not use offset": the engine core died, seen
        # in a SmolLM2 run with 16+ seeded ~95-token prompts at once). Step budget: max(max_model_len, 2048).
        cmd += ["--disable-uvicorn-access-log", "--no-enable-chunked-prefill"]
        if self.max_model_len:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        cores = len(os.sched_getaffinity(0))
        env = dict(os.environ)
        if self.threads:
            # Unbound, this many OpenMP threads: on cores other processes share, threads pinned to every
            # core spin against them (measured here under load ~28: 0.7 tokens/s for the tiny model).
            threads = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(self.threads)}
        else:
            # Every core: without this vLLM-CPU binds one core and reserves the rest (~0.6x batched throughput).
            threads = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}"}
        env.update(
            {
                "VLLM_SERVER_DEV_MODE": "1",  # exposes /collective_rpc, /pause, /resume, /reset_prefix_cache
                "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gb),
                **threads,
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "HF_HUB_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(SERVER_KEEPALIVE_S),
                "PYTHONPATH": str(EXTENSION_DIR),
            }
        )
        env.pop("PYTHONHOME", None)
        return env

    async def start(self) -> None:
        """Start the server and wait until it answers /health; VllmEngineError (with its log's tail) if not."""
        import aiohttp

        if self._session is not None:
            return
        if self._closing:
            raise RuntimeError("VllmEngine was stopped; build a new one")
        if not self.python.is_file():
            raise VllmEngineError(
                f"no vLLM venv: {self.python} does not exist (build it with `make vllm-venv`, "
                "or set [engine] vllm_python)"
            )
        self._specs, self._aliases = await asyncio.to_thread(checkpoint_specs, self.model_dir)
        self._adapter_specs = self.adapter_specs()
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        if self.log_path is None:
            self.log_path = Path(tempfile.mkstemp(prefix="slipstream-vllm-", suffix=".log")[1])
        self._log_file = open(self.log_path, "wb")  # noqa: SIM115 - held for the server's lifetime
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.command(port),
            env=self.environment(),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stop() ends the API server, engine core and workers
        )
        log.info("starting vLLM (pid %d) on %s, log %s", self.proc.pid, self.url, self.log_path)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)
        self._session = aiohttp.ClientSession(connector=connector)
        try:
            await self._wait_healthy(t0)
        except BaseException:
            await self._shutdown()
            raise
        self._stats["start_s"] = time.monotonic() - t0
        self._open.set()
        self._idle.set()
        self._updates = asyncio.Queue()
        self._updater = asyncio.create_task(self._update_loop(), name="vllm-engine-updates")

    async def _wait_healthy(self, t0: float) -> None:
        import aiohttp

        assert self._session is not None and self.proc is not None
        while True:
            code = self.proc.poll()
            if code is not None:
                raise VllmEngineError(f"the vLLM server exited with code {code} while starting:\n{self.log_tail()}")
            if time.monotonic() - t0 > self.start_timeout_s:
                raise VllmEngineError(
                    f"the vLLM server at {self.url} did not answer /health within {self.start_timeout_s:g}s:\n"
                    f"{self.log_tail()}"
                )
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with self._session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.5)

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    async def stop(self) -> None:
        """Abort this engine's requests (they return with 'abort'), then end the server's process group."""
        self._closing = True
        for task in list(self._streams.values()):
            task.cancel()
        for _ in range(1000):
            if not self._streams:
                break
            await asyncio.sleep(0.01)
        if self._updater is not None:
            self._updater.cancel()
            await asyncio.gather(self._updater, return_exceptions=True)
            self._updater = None
        self._open.set()  # callers waiting on an update see _closing and fail
        await self._shutdown()

    async def _shutdown(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        proc, self.proc = self.proc, None
        if proc is not None:
            await asyncio.to_thread(terminate_group, proc)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    # ----------------------------------------------------------------- generate
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if self._session is None or self._closing:
            raise RuntimeError("VllmEngine is not running: await engine.start() first (and not after stop())")
        if request.request_id in self._streams:
            raise ValueError(f"request {request.request_id!r} is already in flight")
        queued = time.time()
        while not self._open.is_set():  # an update is waiting for, or applying after, the requests in flight
            await self._open.wait()
            if self._closing:
                raise RuntimeError("VllmEngine is not running: it was stopped while this request waited")
        version = self._version
        ids: list[int] = []
        logprobs: list[float] = []
        finish: list[str] = []
        started = time.time()
        task = asyncio.create_task(self._stream(request, ids, logprobs, finish))
        self._streams[request.request_id] = task
        self._idle.clear()
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            del self._streams[request.request_id]
            if not self._streams:
                self._idle.set()
        if task.cancelled():
            reason = "abort"
            self._stats["requests_aborted"] += 1
        else:
            task.result()  # raises what the stream raised
            reason = finish[0] if finish else "abort"
        self._stats["requests"] += 1
        self._stats["tokens_generated"] += len(ids)
        n = min(len(ids), len(logprobs))
        done = time.time()
        return GenerationResult(
            request_id=request.request_id,
            prompt_ids=list(request.prompt_ids),
            completion_ids=ids[:n],
            logprobs=logprobs[:n],
            segments=[(version, n)] if n else [],
            finish_reason=reason if reason in ("stop", "length") else "abort",  # type: ignore[arg-type]
            timings=Timings(queued_at=queued, started_at=started, finished_at=done, generate_s=done - queued),
        )

    def _body(self, request: GenerationRequest) -> dict[str, Any]:
        p = request.params
        body: dict[str, Any] = {
            "model": SERVED_NAME,
            "prompt": list(request.prompt_ids),
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k,  # 0 disables, as here
            "ignore_eos": p.ignore_eos,
            "logprobs": 0,
            "return_token_ids": True,
            "stream": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        }
        if p.stop:
            body["stop"] = list(p.stop)
        if p.stop_token_ids:
            body["stop_token_ids"] = list(p.stop_token_ids)
        if p.seed is not None:
            body["seed"] = p.seed
        return body

    async def _stream(
        self, request: GenerationRequest, ids: list[int], logprobs: list[float], finish: list[str]
    ) -> None:
        import aiohttp

        assert self._session is not None
        url = self.url + "/v1/completions"
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        try:
            async with self._session.post(url, json=self._body(request), timeout=timeout) as resp:
                if resp.status >= 400:
                    text = (await resp.read())[:500].decode("utf-8", "replace")
                    if resp.status == 400:
                        raise ValueError(f"vLLM refused request {request.request_id!r}: {text}")
                    raise VllmEngineError(f"POST {url} answered {resp.status}: {text}")
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise VllmEngineError(f"vLLM failed request {request.request_id!r}: {chunk['error']}")
                    for choice in chunk.get("choices", ()):
                        ids.extend(int(t) for t in choice.get("token_ids") or ())
                        lp = choice.get("logprobs") or {}
                        logprobs.extend(float(x) for x in lp.get("token_logprobs") or ())
                        if choice.get("finish_reason"):
                            finish.append(str(choice["finish_reason"]))
        except TimeoutError:
            raise VllmEngineError(f"POST {url} got no full answer within {self.request_timeout_s:g}s") from None
        except aiohttp.ClientConnectionError as exc:
            raise VllmEngineError(f"vLLM server {self.url} is unreachable: {exc}\n{self.log_tail(10)}") from None

    def release(self, session_id: str) -> None:
        """Nothing to drop: vLLM keeps no sessions (its prefix cache is shared and evicts by itself)."""

    # ----------------------------------------------------------------- weights
    def adapter_specs(self) -> dict[str, ParamSpec]:
        """LoRA: the adapters a version may carry (`vllm_lora.adapter_specs`); {} without LoRA."""
        from slipstream.engine.vllm_lora import adapter_specs

        return adapter_specs(self._specs, self.lora_targets, self.lora_rank, self.model_dir)

    def apply_weights(self, version: int, tensors: Mapping[str, Tensor]) -> None:
        """Check the update against the checkpoint's tensors (ValueError naming the tensor; nothing
        queued then), then queue it. The caller must not modify `tensors` meanwhile. With LoRA a
        version may be adapters only (merged when it is applied)."""
        from slipstream.engine.weight_update import WeightUpdate, validate_against

        if self._updates is None or self._loop is None:
            raise RuntimeError("VllmEngine is not running: await engine.start() first")
        from slipstream.engine.vllm_lora import split_adapters

        rest, adapters = split_adapters(self._adapter_specs, tensors)
        if adapters and not rest:
            if isinstance(version, bool) or not isinstance(version, int):
                raise ValueError(f"apply_weights: version must be an int, got {version!r}")
            update = WeightUpdate(version=version, tensors={})
        else:
            partial = self.partial or bool(self.lora_rank)  # a LoRA run's base is frozen: adapters are its versions
            update = validate_against(self._specs, self._aliases, version, rest, partial=partial)
        item = (update.version, update.tensors, adapters)
        if threading.get_ident() == self._loop_thread:
            self._updates.put_nowait(item)
        else:
            self._loop.call_soon_threadsafe(self._updates.put_nowait, item)

    async def _update_loop(self) -> None:
        assert self._updates is not None
        while True:
            version, tensors, adapters = await self._updates.get()
            try:
                await self._apply(version, tensors, adapters)
            except Exception as exc:  # counted, logged and kept: the version never appears
                self._stats["weight_update_failures"] += 1
                self.last_update_error = repr(exc)
                log.error("weight version %d not applied to vLLM at %s: %s", version, self.url, exc)
            finally:
                self._open.set()

    def merged_version(self, tensors: Mapping[str, Tensor], adapters: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """LoRA: what vLLM loads for a version — every checkpoint tensor (so nothing is left unloaded),
        overlaid with the version's own full tensors, and every adapted module's weight replaced by
        `W + scale · B A` (float32) from `adapters` over the newest ones applied (`self._adapters`, which
        takes them only once vLLM has loaded the version)."""
        from slipstream.engine.lora import merge_adapters

        if self._base is None:
            self._base = self._checkpoint()
        full = {**self._base, **{n: t.detach().to("cpu") for n, t in tensors.items()}}
        full.update(merge_adapters(self._base, {**self._adapters, **adapters}, self.lora_scale))
        return full

    async def _apply(self, version: int, tensors: dict[str, Tensor], adapters: dict[str, Tensor] | None = None) -> None:
        from safetensors.torch import save_file

        self._open.clear()  # requests sent from now on wait for this version
        t0 = time.perf_counter()
        await self._idle.wait()  # every request of this engine finished on the old version
        t1 = time.perf_counter()
        merge_ms = 0.0
        own = tensors  # what this version sent (kept for state_dict; merged weights are not kept, ~4 bytes a weight)
        if adapters or (self._adapters and tensors):
            tensors = await asyncio.to_thread(self.merged_version, tensors, adapters or {})
            merge_ms = (time.perf_counter() - t1) * 1000.0
        fd, name = tempfile.mkstemp(prefix="slipstream-weights-", suffix=".safetensors")
        os.close(fd)
        try:
            host = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
            await asyncio.to_thread(save_file, host, name)
            await self._post("/pause?mode=wait")
            try:
                answer = await self._post("/collective_rpc", {"method": "slipstream_load", "args": [name]})
                await self._post("/reset_prefix_cache")
            finally:
                await self._post("/resume")
        finally:
            os.unlink(name)
        log.debug("vLLM loaded version %d: %s", version, answer)
        self._applied.update(own)
        self._adapters.update(adapters or {})
        del tensors
        self._version = version
        self._stats["weight_updates"] += 1
        self._stats["update_wait_ms"] = (t1 - t0) * 1000.0
        self._stats["last_lora_merge_ms"] = merge_ms
        self._stats["last_weight_apply_ms"] = (time.perf_counter() - t1) * 1000.0

    async def _post(self, path: str, body: Any = None) -> Any:
        import aiohttp

        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self.weights_timeout_s)
        try:
            async with self._session.post(self.url + path, json=body, timeout=timeout) as resp:
                raw = await resp.read()
                if resp.status >= 400:
                    raise VllmEngineError(f"POST {self.url}{path} answered {resp.status}: {raw[:500]!r}")
        except TimeoutError:
            raise VllmEngineError(f"POST {self.url}{path} got no answer within {self.weights_timeout_s:g}s") from None
        return json.loads(raw) if raw.strip() else None

    async def call_worker(self, method: str, *args: Any) -> Any:
        """Call a worker-extension method on every worker (its answers, one per worker)."""
        answer = await self._post("/collective_rpc", {"method": method, "args": list(args)})
        return answer.get("results", answer) if isinstance(answer, dict) else answer

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The checkpoint's tensors overlaid with every version applied (HF names; a copy, not live)."""
        from torch import nn

        for name, value in self._weights().items():
            yield name, nn.Parameter(value, requires_grad=False)

    def state_dict(self) -> Mapping[str, Any]:
        params = self._weights()
        for alias, target in self._aliases.items():
            params[alias] = params[target]
        return params

    def _checkpoint(self) -> dict[str, Tensor]:
        """The checkpoint's tensors as read from `model_dir`, tied aliases left out."""
        from slipstream.engine.loading import read_state_dict

        state = read_state_dict(self.model_dir)
        for alias in self._aliases:
            state.pop(alias, None)
        return state

    def _weights(self) -> dict[str, Tensor]:
        state = self._checkpoint()
        state.update(self._applied)
        if self._adapters:  # LoRA: the merged weights vLLM was given, merged again from the newest adapters
            from slipstream.engine.lora import merge_adapters

            state.update(merge_adapters(self._base or state, self._adapters, self.lora_scale))
        return state
