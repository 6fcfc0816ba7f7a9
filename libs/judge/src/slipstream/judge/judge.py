"""A rubric judge: K sampled rubrics, one verdict each from an OpenAI-compatible model, aggregated.

    episode --K of M rubrics (seeded by episode id)--> per rubric: cache? --> call --> parse
                                                         (re-ask on malformed, retry on 429/timeout/5xx)
            --> scores + failures --> aggregate, or *unscorable* when too few rubrics were scored

Every call goes through the `openai` client (`AsyncOpenAI`, its own retries off: this module
retries, so each attempt is limited and counted) to any endpoint that speaks
`/v1/chat/completions`, Slipstream's own included. Per judge: at most `concurrency` calls in
flight (a semaphore), at most `rate_per_s` call starts per second (a token bucket), `timeout_s`
per call. A 429 waits what its Retry-After asks (capped at `max_backoff_s`), other retryable
failures back off exponentially, both within `call_retries`; then the rubric is unscorable. A
malformed verdict is re-asked up to `parse_retries` times with the problem named. A 4xx other
than 429 (bad request, auth) is not retried: asking again cannot fix it.

The judge never invents a score: a rubric it could not score is recorded under `failures` with
the reason, and when fewer than `min_scored` rubrics (default all K) were scored the whole
`Judgement` is unscorable. Everything is asynchronous network I/O; callers run many `judge()`
calls at once on one event loop and the limits above apply across all of them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import openai

from slipstream.judge.aggregation import aggregate
from slipstream.judge.cache import VerdictCache, cache_key
from slipstream.judge.config import JudgeConfig
from slipstream.judge.limits import TokenBucket, retry_after_s
from slipstream.judge.rubrics import Rubric, RubricSet, load_rubric_sets, sample_rubrics, select_set
from slipstream.judge.verdict import (
    JudgeInput,
    MalformedVerdict,
    judge_messages,
    parse_verdict,
    prompt_digest,
    reask_message,
)
from slipstream.runtime.backoff import Backoff
from slipstream.schemas import Judgement
from slipstream.telemetry.logs import get_logger
from slipstream.telemetry.metrics import counter, histogram

log = get_logger(__name__)

CALLS = counter("judge/call/requests", "Calls to a judge endpoint (labels judge, outcome).")
LATENCY = histogram(
    "judge/call/latency_s",
    "Seconds per call to a judge endpoint, answered or not (label judge).",
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
MALFORMED = counter(
    "judge/verdict/malformed", "Verdicts that did not follow the format, re-asked or given up (label judge)."
)
CACHE_HITS = counter("judge/cache/hits", "Rubric verdicts served by the Redis cache (label judge).")
CACHE_MISSES = counter("judge/cache/misses", "Rubric verdicts looked up in the cache and not found (label judge).")
RUBRIC_SCORE = histogram(
    "judge/rubric/score",
    "Each rubric's score in [0, 1] (labels judge, rubric): a rubric drifting from the others shows here.",
    buckets=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
)
RUBRIC_FAILED = counter("judge/rubric/unscorable", "Rubrics that could not be scored (labels judge, reason).")
EPISODES = counter("judge/episode/judged", "Episodes judged (labels judge, outcome: scored | unscorable).")

PREFILL_EXTRAS = {"continue_final_message": True, "add_generation_prompt": False}
"""With a prefill: continue the last (assistant) message instead of opening a new turn (vLLM's extras)."""

RETRYABLE = ("timeout", "connection", "rate_limited", "server_error")


class CallFailed(Exception):
    """A judge call that failed past its retry budget (or could never succeed); `kind` is the counted reason."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


@dataclass(frozen=True)
class RubricResult:
    """One rubric's outcome: a score in [0, 1], or the reason it has none."""

    rubric_id: str
    score: float | None
    failure: str = ""
    detail: str = ""
    cached: bool = False


@dataclass
class JudgeStats:
    """What this judge did since it started (also exported as metrics)."""

    calls: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    malformed: int = 0
    retries: dict[str, int] = field(default_factory=dict)
    rubric_failures: dict[str, int] = field(default_factory=dict)
    judged: int = 0
    unscorable: int = 0


class Judge:
    """One configured judge: its rubric set, limits, client and (optional) cache. See the module docstring."""

    def __init__(
        self,
        name: str,
        cfg: JudgeConfig,
        rubric_set: RubricSet,
        *,
        api_key: str,
        cache: VerdictCache | None = None,
        client: openai.AsyncOpenAI | None = None,
        quiet: bool = False,
    ) -> None:
        if not cfg.url or not cfg.model:
            raise ValueError(f"judge {name!r}: url and model must be set")
        self.name = name
        self.cfg = cfg
        self.rubric_set = rubric_set
        self.cache = cache
        # The SDK's own retries are off: each attempt must pass the limits below and be counted.
        self.client = client or openai.AsyncOpenAI(
            base_url=cfg.url, api_key=api_key, timeout=cfg.timeout_s, max_retries=0
        )
        self._sem = asyncio.Semaphore(cfg.concurrency)
        self._bucket = TokenBucket(cfg.rate_per_s, cfg.burst)
        self.stats = JudgeStats()
        # Quiet: a rubric given up on is only counted (`stats.rubric_failures`, the Judgement's
        # `failures`), not logged: for a caller that reports the counts itself (the realtime demo's console).
        self.quiet = quiet

    @classmethod
    def from_config(
        cls, name: str, cfg: JudgeConfig, *, cache: VerdictCache | None = None, api_key: str | None = None
    ) -> Judge:
        """A judge from its config: the rubric file is loaded and checked, the API key resolved."""
        cfg.check(name)
        sets = load_rubric_sets(cfg.rubric_file)
        rubric_set = select_set(sets, cfg.context, cfg.version, source=cfg.rubric_file)
        if cfg.k > len(rubric_set.rubrics):
            raise ValueError(
                f"[reward.judges.{name}] k {cfg.k} exceeds the {len(rubric_set.rubrics)} rubrics of {rubric_set.label}"
            )
        key = cfg.api_key() if api_key is None else api_key
        return cls(name, cfg, rubric_set, api_key=key, cache=cache)

    @property
    def provenance(self) -> str:
        """'<model> <context@version>', for logs."""
        return f"{self.cfg.model} {self.rubric_set.label}"

    async def close(self) -> None:
        await self.client.close()

    # -- an episode -------------------------------------------------------------------------------
    async def judge(self, item: JudgeInput) -> Judgement:
        """K rubrics judged concurrently and aggregated; unscorable when fewer than `min_scored` were scored."""
        rubrics = sample_rubrics(self.rubric_set, self.cfg.k, item.episode_id)
        results = await asyncio.gather(*(self.score_rubric(r, item) for r in rubrics))
        scores = {r.rubric_id: r.score for r in results if r.score is not None}
        failures = {r.rubric_id: r.failure for r in results if r.score is None}
        need = self.cfg.min_scored or len(rubrics)
        unscorable = ""
        if len(scores) < need:
            why = "; ".join(f"{r.rubric_id}: {r.failure} ({r.detail})" for r in results if r.score is None)
            unscorable = f"judge {self.name}: {len(scores)} of {len(rubrics)} rubrics scored, {need} needed: {why}"
        weights = {r.id: r.weight for r in rubrics}
        agg = (
            aggregate(scores, weights, self.cfg.aggregation, pass_threshold=self.cfg.pass_threshold)
            if scores and not unscorable
            else 0.0
        )
        self.stats.judged += 1
        self.stats.unscorable += bool(unscorable)
        EPISODES.add(1, judge=self.name, outcome="unscorable" if unscorable else "scored")
        return Judgement(
            judge=self.name,
            model=self.cfg.model,
            rubric_set=self.rubric_set.label,
            rubric_ids=[r.id for r in rubrics],
            scores=scores,
            failures=failures,
            aggregate=agg,
            aggregation=self.cfg.aggregation,
            cached=sum(r.cached for r in results),
            unscorable=unscorable,
        )

    # -- a rubric ---------------------------------------------------------------------------------
    async def score_rubric(self, rubric: Rubric, item: JudgeInput) -> RubricResult:
        """One rubric's verdict: from the cache, or asked (re-asked while malformed, within the budget)."""
        base = judge_messages(rubric.text, item)
        # A prefill is the start of the judge's own answer, left open for it to continue.
        opened = [{"role": "assistant", "content": self.cfg.prefill}] if self.cfg.prefill else []
        messages = [*base, *opened]
        digest = prompt_digest(
            messages, model=self.cfg.model, temperature=self.cfg.temperature, max_tokens=self.cfg.max_tokens
        )
        key = cache_key(self.rubric_set.label, rubric.id, digest)
        if self.cache is not None:
            hit = await self.cache.get(key)
            if hit is not None:
                self.stats.cache_hits += 1
                CACHE_HITS.add(1, judge=self.name)
                return RubricResult(rubric.id, hit, cached=True)
            self.stats.cache_misses += 1
            CACHE_MISSES.add(1, judge=self.name)
        convo = list(messages)
        problem = ""
        for _ in range(self.cfg.parse_retries + 1):
            try:
                text = self.cfg.prefill + await self.ask(convo)
            except CallFailed as exc:
                return self._failed(rubric.id, exc.kind, exc.detail)
            try:
                score = parse_verdict(text)
            except MalformedVerdict as exc:
                problem = str(exc)
                self.stats.malformed += 1
                MALFORMED.add(1, judge=self.name)
                # The re-ask shows the judge its own answer and what was wrong with it.
                convo = [*base, {"role": "assistant", "content": text}, reask_message(problem), *opened]
                continue
            RUBRIC_SCORE.observe(score, judge=self.name, rubric=rubric.id)
            if self.cache is not None:
                await self.cache.put(key, score)
            return RubricResult(rubric.id, score)
        return self._failed(rubric.id, "malformed", f"{self.cfg.parse_retries + 1} malformed verdicts, last: {problem}")

    def _failed(self, rubric_id: str, reason: str, detail: str) -> RubricResult:
        self.stats.rubric_failures[reason] = self.stats.rubric_failures.get(reason, 0) + 1
        RUBRIC_FAILED.add(1, judge=self.name, reason=reason)
        if not self.quiet:
            log.warning("rubric unscorable", judge=self.name, rubric=rubric_id, reason=reason, detail=detail[:300])
        return RubricResult(rubric_id, None, failure=reason, detail=detail[:300])

    # -- a call -----------------------------------------------------------------------------------
    async def ask(self, messages: list[dict[str, str]]) -> str:
        """The judge's answer text; retries what may pass on a later try, then raises `CallFailed`."""
        cfg = self.cfg
        retry = Backoff(cfg.backoff_s, max_s=cfg.max_backoff_s)
        for attempt in range(cfg.call_retries + 1):
            kind, detail, wait = await self._attempt(messages)
            if kind == "ok":
                return detail
            if kind not in RETRYABLE or attempt == cfg.call_retries:
                tries = attempt + 1
                raise CallFailed(kind, f"{detail} (after {tries} {'try' if tries == 1 else 'tries'})")
            self.stats.retries[kind] = self.stats.retries.get(kind, 0) + 1
            # A Retry-After is obeyed (within the cap); otherwise the backoff decides.
            await asyncio.sleep(min(cfg.max_backoff_s, wait) if wait is not None else retry.delay(attempt))
        raise AssertionError("unreachable")

    async def _attempt(self, messages: list[dict[str, str]]) -> tuple[str, str, float | None]:
        """One call under the limits: ('ok', text, None) or (failure kind, detail, Retry-After or None)."""
        cfg = self.cfg
        # A prefilled verdict is its one line: the completion continues it and ends at the newline.
        prefill_args: dict[str, Any] = {"stop": ["\n"], "extra_body": PREFILL_EXTRAS} if cfg.prefill else {}
        async with self._sem:
            await self._bucket.acquire()
            self.stats.calls += 1
            started = time.monotonic()
            try:
                async with asyncio.timeout(cfg.timeout_s):
                    resp = await self.client.chat.completions.create(
                        model=cfg.model,
                        messages=messages,  # type: ignore[arg-type]
                        temperature=cfg.temperature,
                        max_tokens=cfg.max_tokens,
                        **prefill_args,
                    )
                kind, detail, wait = "ok", (resp.choices[0].message.content or "") if resp.choices else "", None
            except openai.RateLimitError as exc:
                kind, detail = "rate_limited", f"HTTP 429 from {cfg.url}"
                wait = retry_after_s(dict(exc.response.headers))
            except (openai.APITimeoutError, TimeoutError):
                kind, detail, wait = "timeout", f"no answer within {cfg.timeout_s:g}s from {cfg.url}", None
            except openai.APIConnectionError as exc:
                kind, detail, wait = "connection", f"{cfg.url}: {exc}", None
            except openai.APIStatusError as exc:
                status = exc.status_code
                kind = "server_error" if status >= 500 else "rejected"
                detail = f"HTTP {status} from {cfg.url}: {str(exc)[:200]}"
                wait = retry_after_s(dict(exc.response.headers))
            except openai.APIError as exc:  # an answer the SDK could not read as a chat completion
                kind, detail, wait = "bad_response", f"{cfg.url}: {str(exc)[:200]}", None
            finally:
                LATENCY.observe(time.monotonic() - started, judge=self.name)
        CALLS.add(1, judge=self.name, outcome=kind)
        return kind, detail, wait
