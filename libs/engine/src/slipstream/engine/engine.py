"""TorchEngine: continuous batching over a slot-pool KV cache, with in-flight weight refresh.

Scheduling, one `step()` at a time:
1. apply queued weights, if any (between two decode steps; see DESIGN.md "in-flight weight
   refresh"), timing the pause; optionally recompute running rows' caches under them;
2. retire aborted requests;
3. admit waiting requests into free slots and prefill them together (rows right-padded into a
   few batched forwards), which also samples their first tokens. Prompts are shared: rows with
   the same prompt, such as a GRPO group's samples, are prefilled once, distinct prompts admitted
   together that open alike (a system prompt, a one-shot example) compute that opening once, and
   a prompt that starts like a sequence already cached (running or parked) copies that prefix's
   keys/values;
4. decode every running row in one batched forward (each row at its own position, attending to
   its own slot's valid prefix), sample, and retire rows that hit eos, a stop string,
   max_tokens or max_seq_len. With `speculative_tokens` = k the forward verifies up to k tokens
   per row drafted by the model's MTP modules and emits 1 to k+1 tokens a row (speculative.py:
   exact rejection sampling, the main model's log-probs, all tagged with the version in use).

Sessions (multi-turn episodes): a request with a `session_id` leaves its cache slot *parked*
when it finishes, holding the keys/values of every token it forwarded. The session's next
request (previous prompt + completion + observation) takes that slot back and prefills only the
tokens past the longest prefix it shares with what is cached, so a turn costs its new tokens,
not the whole context. A prompt that shares less (a context edit) reuses what it can and counts
a fallback. Parked slots are the pool's spare capacity: when a request needs a slot and none is
free, the least recently parked session is evicted (counted) and simply re-prefills next time.
`release(session_id)` frees a slot as soon as the caller knows the episode is over. Parked
caches survive weight updates like running rows do (DESIGN: the KV cache is kept by default);
with `recompute_kv_on_update` they are dropped instead of recomputed.

`submit` + `step` are the synchronous core (deterministic tests drive them directly). The async
face (`start`, `generate`, `stop`) runs `step` in a single worker thread so the event loop that
talks to NATS stays responsive while torch works.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from slipstream.engine.driver import StepDriver
from slipstream.engine.interface import GenerationRequest, GenerationResult
from slipstream.engine.kernels import Fp32Weights, MklPackedWeights, choose_kernel, project
from slipstream.engine.model import CausalLM
from slipstream.engine.prefill import MIN_SHARED_PREFIX, Row, prefill_chunks, prefix_clusters, shared_prefix
from slipstream.engine.sampling import sample
from slipstream.engine.sequence import SequenceState
from slipstream.engine.speculative import Speculator
from slipstream.engine.tokenizer import Tokenizer
from slipstream.engine.weight_update import WeightUpdate, validate_update

log = logging.getLogger(__name__)

# Throughput in stats() is measured over this many recent steps.
_RATE_WINDOW_STEPS = 64


class TorchEngine:
    """The Engine protocol on a plain-torch CausalLM (CPU or CUDA)."""

    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        *,
        max_batch: int = 32,
        max_seq_len: int | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        policy_version: int = 0,
        recompute_kv_on_update: bool = False,
        allow_partial_updates: bool = False,
        bf16_upcast: bool | None = None,
        mkl_pack: bool | None = None,
        speculative_tokens: int = 0,
    ) -> None:
        """`bf16_upcast`: run a bf16 model's matmuls in fp32 on the same bf16 values (kernels.py),
        keeping an fp32 copy of the weights (4 bytes per parameter); None decides by device (on
        for CPUs whose torch lacks a fast bf16 GEMM). No effect in fp32.
        `mkl_pack`: run an fp32 model's decode matmuls with MKL's packed GEMM (kernels.py),
        keeping an MKL-packed copy of the weights (4 bytes per parameter); None turns it on
        wherever it can run (CPU, fp32, torch built with MKL). No effect elsewhere.
        `speculative_tokens`: draft up to this many tokens per row and step with the model's MTP
        modules and verify them in one forward (speculative.py; the model needs mtp_depth >= it);
        0 (the default) decodes one token per row and step."""
        if max_batch < 1:
            raise ValueError(f"TorchEngine max_batch must be >= 1, got {max_batch}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.model = model.to(device=self.device, dtype=dtype).eval()
        # The matmul kernel of the cached forward and its weight copies (None: torch's F.linear).
        self._kernel = choose_kernel(self.device, dtype, bf16_upcast=bf16_upcast, mkl_pack=mkl_pack)
        self.bf16_upcast = isinstance(self._kernel, Fp32Weights)
        self.mkl_pack = isinstance(self._kernel, MklPackedWeights)
        self.tokenizer = tokenizer
        cfg = model.config
        self.max_seq_len = max_seq_len or min(cfg.max_position_embeddings, 2048)
        if self.max_seq_len < 2:
            raise ValueError(f"TorchEngine max_seq_len must be >= 2, got {self.max_seq_len}")
        self.max_batch = max_batch
        self.recompute_kv_on_update = recompute_kv_on_update
        self.allow_partial_updates = allow_partial_updates
        self._speculator = Speculator(self.model, speculative_tokens) if speculative_tokens else None
        # Room past max_seq_len for a verify forward's padding (speculative.py).
        self.cache = self.model.new_cache(max_batch, self.max_seq_len + speculative_tokens)
        self._slots: list[SequenceState | None] = [None] * max_batch
        self._waiting: collections.deque[SequenceState] = collections.deque()
        self._known_ids: set[str] = set()
        self._abort_ids: set[str] = set()
        self._pending: WeightUpdate | None = None
        # session id -> (slot, tokens whose keys/values that slot holds), least recently parked first
        self._parked: collections.OrderedDict[str, tuple[int, list[int]]] = collections.OrderedDict()
        self._release_ids: set[str] = set()
        self._lock = threading.Lock()
        self._seed_stream = torch.Generator().manual_seed(seed)
        self._policy_version = policy_version
        # counters for stats()
        self._steps = 0
        self._tokens = 0
        self._prefill_tokens = 0
        self._finished = 0
        self._aborted = 0
        self._weight_updates = 0
        self._kv_reused_tokens = 0
        self._prompt_shared_tokens = 0
        self._session_hits = 0
        self._session_fallbacks = 0
        self._session_evictions = 0
        self._spec_drafted = 0
        self._spec_accepted = 0
        self._last_apply_ms = 0.0
        self._recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=_RATE_WINDOW_STEPS)
        self._driver = StepDriver(
            "TorchEngine",
            submit=self.submit,
            abort=self.abort,
            abort_all=self._abort_all,
            step=self.step,
            has_work=lambda: self.has_work,
        )

    # ----------------------------------------------------------------- protocol: weights & state
    @property
    def policy_version(self) -> int:
        """Version of the weights in use; a queued update counts once a step has applied it."""
        return self._policy_version

    @property
    def error(self) -> BaseException | None:
        """Why the engine loop died, or None while it is healthy (a readiness probe reads this)."""
        return self._driver.error

    @property
    def pending_version(self) -> int | None:
        with self._lock:
            return None if self._pending is None else self._pending.version

    def apply_weights(self, version: int, tensors: Mapping[str, Tensor], *, partial: bool | None = None) -> None:
        """Queue new weights; the next step copies them in before sampling anything.

        Raises ValueError naming the offending tensor (unknown name, wrong shape or dtype, or
        missing names unless partial updates are allowed); nothing is queued then. The engine
        holds on to `tensors` until the copy, so the caller must not modify them meanwhile.
        """
        partial = self.allow_partial_updates if partial is None else partial
        update = validate_update(self.model, version, tensors, partial=partial)
        with self._lock:
            self._pending = update if self._pending is None else self._pending.merged(update)
        self._notify()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.model.named_parameters()

    def state_dict(self) -> Mapping[str, Any]:
        return self.model.state_dict()

    def stats(self) -> dict[str, float]:
        busy = sum(d for d, _ in self._recent)
        made = sum(n for _, n in self._recent)
        with self._lock:
            waiting = len(self._waiting)
        return {
            "policy_version": float(self._policy_version),
            "steps": float(self._steps),
            "tokens_generated": float(self._tokens),
            "prefill_tokens": float(self._prefill_tokens),
            "running": float(self.num_running),
            "waiting": float(waiting),
            "tokens_per_s": made / busy if busy > 0 else 0.0,
            "requests_finished": float(self._finished),
            "requests_aborted": float(self._aborted),
            "weight_updates": float(self._weight_updates),
            "last_weight_apply_ms": self._last_apply_ms,
            "kv_sessions_parked": float(len(self._parked)),
            "kv_reused_tokens": float(self._kv_reused_tokens),
            "prompt_shared_tokens": float(self._prompt_shared_tokens),
            "kv_session_hits": float(self._session_hits),
            "kv_session_fallbacks": float(self._session_fallbacks),
            "kv_session_evictions": float(self._session_evictions),
            "spec_drafted_tokens": float(self._spec_drafted),
            "spec_accepted_tokens": float(self._spec_accepted),
            "spec_acceptance_rate": self._spec_accepted / self._spec_drafted if self._spec_drafted else 0.0,
        }

    def release(self, session_id: str) -> None:
        """Free a session's parked cache slot at the next step (unknown or empty ids are ignored)."""
        if not session_id:
            return
        with self._lock:
            self._release_ids.add(session_id)
        self._notify()

    def progress(self, request_id: str) -> tuple[list[int], list[float]] | None:
        """A running request's completion so far (ids, log-probs), or None while it is not in a slot
        (queued, finished, unknown): a snapshot for streaming tokens as they are sampled. Safe from
        the event loop while the engine thread appends (the two lists are cut to their common length)."""
        for seq in list(self._slots):
            if seq is not None and seq.request_id == request_id:
                ids, logprobs = list(seq.completion), list(seq.logprobs)
                n = min(len(ids), len(logprobs))
                return ids[:n], logprobs[:n]
        return None

    # ----------------------------------------------------------------- synchronous core
    @property
    def num_running(self) -> int:
        return sum(s is not None for s in self._slots)

    @property
    def has_work(self) -> bool:
        with self._lock:
            queued = bool(self._waiting or self._pending is not None or self._abort_ids)
        return queued or self.num_running > 0

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request (validated here: a bad prompt or a duplicate id raises ValueError)."""
        prompt = request.prompt_ids
        if not prompt:
            raise ValueError(f"request {request.request_id!r}: prompt_ids is empty")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request.request_id!r}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        if len(prompt) >= self.max_seq_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt has {len(prompt)} tokens, "
                f"max_seq_len {self.max_seq_len} leaves no room to generate"
            )
        seed = request.params.seed
        with self._lock:
            if request.request_id in self._known_ids:
                raise ValueError(f"request {request.request_id!r} is already in flight")
            if seed is None:
                # Unseeded requests still get their own stream, derived in submission order.
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_stream))
            self._known_ids.add(request.request_id)
            self._waiting.append(SequenceState(request, torch.Generator().manual_seed(seed)))
        self._notify()

    def abort(self, request_id: str) -> bool:
        """Ask the next step to stop a request (its result comes back with finish_reason 'abort')."""
        with self._lock:
            if request_id not in self._known_ids:
                return False
            self._abort_ids.add(request_id)
        self._notify()
        return True

    def step(self) -> list[GenerationResult]:
        """One scheduler iteration; returns the requests that finished in it."""
        t0 = time.perf_counter()
        tokens_before = self._tokens
        done: list[SequenceState] = []
        with torch.no_grad():
            self._apply_pending()
            self._release_parked()
            self._reap_aborted(done)
            self._admit(done)
            self._decode(done)
        with self._lock:
            for seq in done:
                self._known_ids.discard(seq.request_id)
                self._abort_ids.discard(seq.request_id)
        self._steps += 1
        self._recent.append((time.perf_counter() - t0, self._tokens - tokens_before))
        self._finished += len(done)
        return [seq.result() for seq in done]

    def _apply_pending(self) -> None:
        with self._lock:
            update, self._pending = self._pending, None
        if update is None:
            return
        t0 = time.perf_counter()
        update.copy_into(self.model)
        if self._kernel is not None:
            self._kernel.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._policy_version = update.version
        if self.recompute_kv_on_update:
            for seq in self._running():
                self._forward_from(seq, 0, seq.tokens[: seq.cache_len])
            self._parked.clear()
        self._last_apply_ms = (time.perf_counter() - t0) * 1000.0
        self._weight_updates += 1
        log.info("applied weights version %d in %.1f ms", update.version, self._last_apply_ms)

    def _reap_aborted(self, done: list[SequenceState]) -> None:
        with self._lock:
            ids = set(self._abort_ids)
            if not ids:
                return
            kept = [s for s in self._waiting if s.request_id not in ids]
            dropped = [s for s in self._waiting if s.request_id in ids]
            self._waiting = collections.deque(kept)
        for seq in [*dropped, *(s for s in self._running() if s.request_id in ids)]:
            self._retire(seq, "abort", done)
            self._aborted += 1

    def _release_parked(self) -> None:
        with self._lock:
            ids, self._release_ids = self._release_ids, set()
        for session in ids:
            self._parked.pop(session, None)

    def _admit(self, done: list[SequenceState]) -> None:
        """Give waiting requests slots (a session its parked one), then prefill them together."""
        batch: list[tuple[SequenceState, int]] = []
        while True:
            with self._lock:
                if not self._waiting:
                    break
                seq = self._waiting[0]
            session = seq.request.session_id
            parked = self._parked.pop(session, None) if session else None
            if parked is not None:
                slot, cached = parked
                keep = shared_prefix(cached, seq.tokens)
                if keep == len(cached):
                    self._session_hits += 1
                else:
                    self._session_fallbacks += 1
            else:
                free = self._free_slot()
                if free is None:
                    break
                slot, keep = free, 0
                # A prompt that starts like a cached sequence (a group's sample admitted after
                # its siblings started) copies their keys/values instead of recomputing them.
                donor, shared = self._best_donor(seq.tokens)
                if shared >= MIN_SHARED_PREFIX:
                    self.cache.copy_prefix(donor, [slot], shared)
                    self._prompt_shared_tokens += shared
                    seq.shared_prefix = shared
                    keep = shared
            with self._lock:
                self._waiting.popleft()
            seq.slot = slot
            seq.started_at = time.time()
            self._slots[slot] = seq
            # At least the last prompt token goes through a forward: its logits give the first sample.
            batch.append((seq, min(keep, len(seq.tokens) - 1)))
        if batch:
            self._prefill(batch, done)

    def _best_donor(self, tokens: list[int]) -> tuple[int, int]:
        """The slot (running or parked) whose cached tokens share the longest prefix with `tokens`,
        and that length, at most len(tokens) - 1 (the last token's logits are still needed)."""
        best, best_len = -1, 0
        limit = len(tokens) - 1
        candidates = [(s.slot, s.tokens, s.cache_len) for s in self._slots if s is not None and s.cache_len > 0]
        candidates += [(slot, cached, len(cached)) for slot, cached in self._parked.values()]
        for slot, cached, length in candidates:
            if min(length, limit) <= best_len:
                continue
            n = min(shared_prefix(cached, tokens), length, limit)
            if n > best_len:
                best, best_len = slot, n
        return best, best_len

    def _prefill(self, batch: list[tuple[SequenceState, int]], done: list[SequenceState]) -> None:
        """Forward each admitted row's uncached tokens, a few rows per forward, and sample once.

        Rows starting from an empty slot with the same prompt (a GRPO group's samples) are
        prefilled once: the others copy the leader's keys/values and share its logits, sampling
        from them with their own random streams. Distinct prompts that open alike (a system
        prompt, a one-shot example) prefill that common prefix once (`_share_prefixes`).
        """
        leaders: dict[tuple[int, ...], SequenceState] = {}
        followers: dict[int, list[SequenceState]] = collections.defaultdict(list)
        work: list[tuple[SequenceState, int]] = []
        for seq, keep in batch:
            if keep == 0:
                leader = leaders.setdefault(tuple(seq.tokens), seq)
                if leader is not seq:
                    followers[id(leader)].append(seq)
                    continue
            work.append((seq, keep))
        work = self._share_prefixes(work)
        rows: list[SequenceState] = []
        logits: list[Tensor] = []
        for chunk in prefill_chunks(work, self.max_seq_len):
            chunk_hidden = self._forward_rows(chunk)
            chunk_logits = project(self.model.lm_head, chunk_hidden, self._kernel)
            for (seq, keep), row_hidden, row_logits in zip(chunk, chunk_hidden, chunk_logits, strict=True):
                self._prefill_tokens += len(seq.tokens) - keep
                self._kv_reused_tokens += keep - seq.shared_prefix
                rows.append(seq)
                logits.append(row_logits)
                if self._speculator is not None:
                    seq.draft_hidden = row_hidden
                shared = followers.get(id(seq), [])
                if shared:
                    self.cache.copy_prefix(seq.slot, [f.slot for f in shared], len(seq.tokens))
                    for f in shared:
                        f.cache_len = len(f.tokens)
                        self._prompt_shared_tokens += len(f.tokens)
                        rows.append(f)
                        logits.append(row_logits)
                        f.draft_hidden = seq.draft_hidden
        self._sample(rows, torch.stack(logits), done)

    def _share_prefixes(self, work: list[Row]) -> list[Row]:
        """Rows from empty slots whose prompts open alike (`prefill.prefix_clusters`) compute that
        opening once: the cluster's first row forwards it into its slot, the others copy those
        keys/values (as a group's samples do), and every member prefills only the rest. The
        keys/values are the ones each row would have computed itself: same tokens, same positions,
        and a causal model's prefix does not look ahead."""
        keeps: dict[int, int] = {}
        for members, shared in prefix_clusters([seq for seq, keep in work if keep == 0]):
            root = members[0]
            self._forward_from(root, 0, root.tokens[:shared])
            self._prefill_tokens += shared
            self.cache.copy_prefix(root.slot, [m.slot for m in members[1:]], shared)
            self._prompt_shared_tokens += shared * (len(members) - 1)
            for m in members:
                m.shared_prefix = shared
                keeps[id(m)] = shared
        return [(seq, keeps.get(id(seq), keep)) for seq, keep in work]

    def _forward_rows(self, chunk: list[tuple[SequenceState, int]]) -> Tensor:
        """One forward of each row's tokens[keep:] into its slot; final-norm hidden states [rows, H]
        at each row's last token (the lm_head makes them logits)."""
        width = max(len(seq.tokens) - keep for seq, keep in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        starts = torch.tensor([keep for _, keep in chunk], dtype=torch.long)
        last = torch.empty(len(chunk), dtype=torch.long)
        for b, (seq, keep) in enumerate(chunk):
            new = seq.tokens[keep:]
            ids[b, : len(new)] = torch.tensor(new, dtype=torch.long)
            last[b] = len(new) - 1
            seq.cache_len = len(seq.tokens)
        pos = starts[:, None] + torch.arange(width)[None]
        return self.model.hidden_cached(
            ids.to(self.device),
            pos.to(self.device),
            self.cache,
            [seq.slot for seq, _ in chunk],
            last=last.to(self.device),
            kernel=self._kernel,
        )

    def _free_slot(self) -> int | None:
        """A slot neither running nor parked; else the least recently parked session's (evicted)."""
        parked = {slot for slot, _ in self._parked.values()}
        for slot, occupant in enumerate(self._slots):
            if occupant is None and slot not in parked:
                return slot
        if self._parked:
            _, (slot, _) = self._parked.popitem(last=False)
            self._session_evictions += 1
            return slot
        return None

    def _forward_from(self, seq: SequenceState, start: int, tokens: list[int]) -> None:
        """Forward `tokens[start:]` at positions start.. into seq's slot (whose keys/values before
        `start` are already there); sets cache_len to len(tokens)."""
        ids = torch.tensor([tokens[start:]], dtype=torch.long, device=self.device)
        pos = torch.arange(start, len(tokens), device=self.device)[None]
        last = torch.tensor([len(tokens) - start - 1], device=self.device)
        self.model.forward_cached(ids, pos, self.cache, [seq.slot], last=last, kernel=self._kernel)
        seq.cache_len = len(tokens)

    def _decode(self, done: list[SequenceState]) -> None:
        rows = self._running()
        if not rows:
            return
        if self._speculator is not None:
            self._decode_speculative(rows, done)
            return
        ids = torch.tensor([[s.tokens[-1]] for s in rows], dtype=torch.long, device=self.device)
        pos = torch.tensor([[s.cache_len] for s in rows], dtype=torch.long, device=self.device)
        last = torch.zeros(len(rows), dtype=torch.long, device=self.device)
        slots = [s.slot for s in rows]
        logits = self.model.forward_cached(ids, pos, self.cache, slots, last=last, kernel=self._kernel)
        for s in rows:
            s.cache_len += 1
        self._sample(rows, logits, done)

    def _decode_speculative(self, rows: list[SequenceState], done: list[SequenceState]) -> None:
        """Draft, verify and accept (speculative.py): 1 to k+1 tokens per row, all tagged with the
        version in use, as one decode step would tag its one."""
        assert self._speculator is not None
        advances = self._speculator.step(rows, self.cache, self._kernel, self.max_seq_len)
        version = self._policy_version
        for seq, adv in zip(rows, advances, strict=True):
            fed_from = seq.cache_len
            for tok, lp in zip(adv.tokens, adv.logprobs, strict=True):
                seq.append(tok, lp, version)
                self._tokens += 1
                seq.check_stop(self.tokenizer, self.max_seq_len)
                if seq.finished:
                    break
            # Valid in the cache now: the token fed last step and the accepted drafts (the rejected
            # ones' keys/values lie past cache_len, masked, and are overwritten next step).
            seq.cache_len = min(fed_from + adv.accepted + 1, len(seq.tokens))
            seq.draft_hidden = adv.hidden
            self._spec_drafted += adv.drafted
            self._spec_accepted += adv.accepted
            if seq.finished:
                self._retire(seq, seq.finish_reason or "stop", done)

    def _sample(self, rows: list[SequenceState], logits: Tensor, done: list[SequenceState]) -> None:
        ids, logps = sample(logits, [s.request.params for s in rows], [s.generator for s in rows])
        version = self._policy_version
        for seq, tok, lp in zip(rows, ids, logps, strict=True):
            seq.append(tok, lp, version)
            seq.check_stop(self.tokenizer, self.max_seq_len)
            if seq.finished:
                self._retire(seq, seq.finish_reason or "stop", done)
        self._tokens += len(rows)

    def _retire(self, seq: SequenceState, reason: str, done: list[SequenceState]) -> None:
        seq.finish(reason)  # type: ignore[arg-type]
        if seq.slot >= 0 and self._slots[seq.slot] is seq:
            # A MoE model's routes of every cached token, for router replay (before the slot is reused).
            seq.routes, seq.routes_per_token = self.cache.route_bytes(seq.slot, seq.cache_len), self.cache.route_width
            self._slots[seq.slot] = None
            session = seq.request.session_id
            if session and reason != "abort" and seq.cache_len > 0:
                # A newer turn of the same session replaces an older parked one (its slot frees).
                self._parked.pop(session, None)
                self._parked[session] = (seq.slot, seq.tokens[: seq.cache_len])
        done.append(seq)

    def _running(self) -> list[SequenceState]:
        return [s for s in self._slots if s is not None]

    # ----------------------------------------------------------------- async face (driver.py)
    async def start(self) -> None:
        await self._driver.start()

    async def stop(self) -> None:
        """Abort everything in flight, let the loop deliver those results, then shut down."""
        await self._driver.stop()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await self._driver.generate(request)

    def _notify(self) -> None:
        self._driver.notify()

    def _abort_all(self) -> None:
        with self._lock:
            self._abort_ids.update(self._known_ids)
