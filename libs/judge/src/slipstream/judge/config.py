"""`JudgeConfig`: one rubric judge, as a `[reward.judges.<name>]` table of the reward-model's config.

The judge lib owns its config fragment (as the bus owns `[bus]`); the reward-model only holds a
table of them by name. Every field has a default except the endpoint and the model, which no
default can guess. The API key is never a config value: it is read once at start from the
environment variable `api_key_env` or the file `api_key_file` (a mounted Secret) and never logged.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

import msgspec

Doc = msgspec.Meta

Aggregation = Literal["mean", "median", "majority"]
AGGREGATIONS: tuple[str, ...] = ("mean", "median", "majority")


class JudgeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One judge: where it is, which rubrics it applies, how its verdicts count, and its limits."""

    url: Annotated[
        str, Doc(description="Base URL of an OpenAI-compatible endpoint, up to /v1 (e.g. http://judge:8000/v1).")
    ] = ""
    model: Annotated[str, Doc(description="Model name sent to the endpoint (and recorded with every score).")] = ""
    api_key_env: Annotated[
        str, Doc(description="Name of the environment variable holding the endpoint's API key; empty = none.")
    ] = ""
    api_key_file: Annotated[
        str, Doc(description="File holding the API key (a mounted Secret); used when `api_key_env` is empty.")
    ] = ""
    envs: Annotated[list[str], Doc(description="Environments whose episodes this judge scores.")] = []
    rubric_file: Annotated[str, Doc(description="TOML or JSON file of rubric sets (libs/judge README).")] = ""
    context: Annotated[str, Doc(description="Task context of the rubric set to use from `rubric_file`.")] = ""
    version: Annotated[
        str, Doc(description="Version of that rubric set; empty when the file holds one version of the context.")
    ] = ""
    k: Annotated[
        int, Doc(description="Rubrics sampled per episode (seeded by episode id); 0 = every rubric of the set.", ge=0)
    ] = 3
    aggregation: Annotated[
        Aggregation, Doc(description="How the rubrics' scores combine: 'mean' (weighted), 'median' or 'majority'.")
    ] = "mean"
    pass_threshold: Annotated[
        float, Doc(description="A rubric scoring at least this (in [0, 1]) votes 'pass' under 'majority'.", ge=0, le=1)
    ] = 0.5
    min_scored: Annotated[
        int,
        Doc(description="Rubrics that must be scored for a usable verdict; 0 = all K. Fewer: unscorable.", ge=0),
    ] = 0
    weight: Annotated[float, Doc(description="The `judge` reward component is weight x aggregate.")] = 1.0
    temperature: Annotated[float, Doc(description="Sampling temperature of the judge's calls.", ge=0)] = 0.0
    max_tokens: Annotated[int, Doc(description="Longest verdict the judge may write.", ge=1)] = 512
    prefill: Annotated[
        str,
        Doc(
            description="Start of the judge's answer, written for it (e.g. 'SCORE:'): the request ends with an "
            "assistant message holding it, sent with continue_final_message (vLLM's extra, Slipstream's "
            "endpoint's too) and stop at a newline, and the verdict parsed is prefill + completion. Empty = none."
        ),
    ] = ""
    concurrency: Annotated[int, Doc(description="Calls in flight to this judge at once.", ge=1, le=4096)] = 8
    rate_per_s: Annotated[
        float, Doc(description="Calls per second to this judge (token bucket); 0 = no rate limit.", ge=0)
    ] = 0.0
    burst: Annotated[int, Doc(description="Token-bucket capacity: calls allowed back to back.", ge=1)] = 1
    timeout_s: Annotated[float, Doc(description="Budget of one call, connect to last byte.", gt=0)] = 60.0
    parse_retries: Annotated[
        int, Doc(description="Re-asks after a malformed verdict before the rubric is unscorable.", ge=0, le=10)
    ] = 2
    call_retries: Annotated[
        int,
        Doc(
            description="Retries after a timeout, a lost connection, a 429 or a 5xx before the rubric is unscorable.",
            ge=0,
            le=20,
        ),
    ] = 3
    backoff_s: Annotated[
        float, Doc(description="First wait after a failed call (doubling each try) when no Retry-After is given.", ge=0)
    ] = 0.5
    max_backoff_s: Annotated[
        float, Doc(description="Longest wait between tries, a server's Retry-After included.", ge=0)
    ] = 30.0
    cache: Annotated[
        bool, Doc(description="Cache verdicts in Redis ([service] redis_url) by rubric, judge model and prompt.")
    ] = True
    cache_ttl_s: Annotated[int, Doc(description="Lifetime of a cached verdict.", ge=1)] = 7 * 24 * 3600

    def check(self, name: str) -> None:
        """Raise ValueError naming the field when the judge cannot work as configured."""
        where = f"[reward.judges.{name}]"
        for field in ("url", "model", "rubric_file", "context"):
            if not getattr(self, field):
                raise ValueError(f"{where} {field} is empty: a judge needs url, model, rubric_file and context")
        if not self.envs:
            raise ValueError(f"{where} envs is empty: name the environments this judge scores")
        if self.min_scored and self.k and self.min_scored > self.k:
            raise ValueError(f"{where} min_scored {self.min_scored} exceeds k {self.k}: no episode could be scored")
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(f"{where} max_backoff_s {self.max_backoff_s} is below backoff_s {self.backoff_s}")

    def api_key(self, environ: Mapping[str, str] | None = None) -> str:
        """The endpoint's key: `$api_key_env`, else the contents of `api_key_file`, else 'none'.

        A named variable that is unset, or an unreadable file, is an error naming it (never a
        silent anonymous call); an endpoint without auth still needs some key for the client.
        """
        env = os.environ if environ is None else environ
        if self.api_key_env:
            key = env.get(self.api_key_env, "")
            if not key:
                raise ValueError(f"judge api_key_env {self.api_key_env!r} names an unset or empty variable")
            return key
        if self.api_key_file:
            try:
                return Path(self.api_key_file).read_text().strip()
            except OSError as exc:
                raise ValueError(f"judge api_key_file {self.api_key_file!r} cannot be read: {exc}") from exc
        return "none"
