"""The wire of Slipstream's inference server: routes, and the JSON bodies both ends share.

Shaped after vLLM's tokens-in/tokens-out route (`POST /inference/v1/generate`: `request_id`,
`token_ids`, `sampling_params` with vLLM's field names; the answer lists `choices` with each
choice's `token_ids`, `logprobs` and `finish_reason`) and its RL routes (`/update_weights`,
`/abort_requests`, `GET /weight_info`). What RL needs beyond vLLM's answer rides along: the
policy version of every completion token, run-length encoded as `segments` (vLLM 0.33 calls
them weight-version spans; AReaL's remote engine keeps them per token), and the server's
engine counters, so a client knows its server's version and counters without polling.

Weight updates travel as safetensors bytes in the request body (`POST /update_weights?version=N`):
`Engine.apply_weights` hands the engine decoded tensors, not an object-store reference (a
version in the store is a delta only the worker's follower can decode against what it holds),
and a body needs nothing shared between worker and server but the socket. A 135M model in
fp32 is ~540 MB per full version over the pod network; the server's `max_body_mb` bounds it.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from slipstream.engine.interface import FinishReason, SamplingParams, Timings

Doc = msgspec.Meta

GENERATE = "/inference/v1/generate"
UPDATE_WEIGHTS = "/update_weights"
WEIGHT_INFO = "/weight_info"
WEIGHTS = "/weights"
ABORT = "/abort_requests"
RELEASE = "/release_session"
HEALTH = "/health"
STATS = "/stats"


class GenerateBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`POST /inference/v1/generate`: one tokenised prompt to complete."""

    request_id: Annotated[str, Doc(description="Caller's id; unique among the server's in-flight requests.")]
    token_ids: Annotated[list[int], Doc(description="Prompt token ids (nothing is added).")]
    sampling_params: Annotated[SamplingParams, Doc(description="vLLM's names: temperature, top_p, ...")] = (
        msgspec.field(default_factory=SamplingParams)
    )
    session_id: Annotated[str, Doc(description="Keep this sequence's KV cache under this key ('' = none).")] = ""


class Choice(msgspec.Struct, kw_only=True):
    """The one completion of a request (n = 1)."""

    index: int = 0
    token_ids: Annotated[list[int], Doc(description="Sampled ids, eos/stop tokens included.")]
    logprobs: Annotated[list[float], Doc(description="Log-prob of each sampled id under the processed distribution.")]
    finish_reason: FinishReason
    segments: Annotated[list[tuple[int, int]], Doc(description="Run-length (policy_version, n_tokens) over token_ids.")]


class GenerateAnswer(msgspec.Struct, kw_only=True):
    """The answer to a generate call: the completion, its timings and the server's counters."""

    request_id: str
    prompt_token_ids: list[int]
    choices: list[Choice]
    timings: Timings
    policy_version: Annotated[int, Doc(description="The server's weights version when it answered.")]
    stats: Annotated[dict[str, float], Doc(description="The server engine's counters when it answered.")]
    server_id: Annotated[str, Doc(description="Random per server process: a new one means it restarted.")] = ""


class ParamInfo(msgspec.Struct, kw_only=True):
    shape: list[int]
    dtype: Annotated[str, Doc(description="torch dtype without 'torch.': 'float32', 'bfloat16', ...")]


class WeightInfo(msgspec.Struct, kw_only=True):
    """`GET /weight_info`: what an update must look like, and the version in use."""

    policy_version: int
    parameters: Annotated[dict[str, ParamInfo], Doc(description="Every parameter, by state_dict name.")]
    aliases: Annotated[dict[str, str], Doc(description="Accepted alternative names (tied lm_head).")]
    partial: Annotated[bool, Doc(description="Updates may name a subset of the parameters (LoRA adapters).")]
    stats: dict[str, float]
    server_id: str = ""


class UpdateAnswer(msgspec.Struct, kw_only=True):
    """`POST /update_weights`: the version is in use when this comes back."""

    policy_version: int
    apply_ms: Annotated[float, Doc(description="The engine's pause between two decode steps for the copy.")]
    stats: dict[str, float]
    server_id: str = ""


class AbortBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    request_ids: list[str]


class ReleaseBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    session_id: str


class ErrorBody(msgspec.Struct, kw_only=True):
    """Every non-2xx answer: `{"error": {"message": ..., "type": ...}}`."""

    message: str
    type: str


class ErrorAnswer(msgspec.Struct, kw_only=True):
    error: ErrorBody
