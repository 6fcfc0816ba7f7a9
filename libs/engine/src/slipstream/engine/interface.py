"""The inference-engine boundary: requests, results and the small `Engine` protocol.

Rollout workers and eval-gate talk to an engine only through this module, so the torch engine
here and a later vLLM adapter are interchangeable (vLLM maps onto it: `generate` = AsyncLLM's
tokens-in/tokens-out generate with processed logprobs, `apply_weights` = pause(keep) +
load_weights + resume). Everything is token ids in, token ids out; text is the caller's business.

Results carry what RL needs from sampling: the behaviour log-probability of every sampled token
(under the distribution actually sampled from) and run-length `segments` of the policy version
that produced each token, because an update can land between two decode steps of a request.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal, NamedTuple, Protocol, runtime_checkable

import msgspec

if TYPE_CHECKING:  # torch stays unimported until an engine is built (fast `--help`)
    from torch import Tensor, nn

Doc = msgspec.Meta

FinishReason = Literal["stop", "length", "abort"]


class ParamSpec(NamedTuple):
    """What an update's tensor must look like to replace a parameter."""

    shape: tuple[int, ...]
    dtype: Annotated[str, Doc(description="torch dtype without 'torch.': 'float32', 'bfloat16', ...")]


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How to sample one completion."""

    temperature: Annotated[float, Doc(description="Softmax temperature; 0 means greedy (argmax).")] = 1.0
    top_p: Annotated[float, Doc(description="Nucleus mass kept, in (0, 1]; 1 disables.")] = 1.0
    top_k: Annotated[int, Doc(description="Keep only the k most likely tokens; 0 disables.")] = 0
    max_tokens: Annotated[int, Doc(description="Most completion tokens to generate.")] = 256
    stop: Annotated[list[str], Doc(description="Stop when the decoded completion contains any of these.")] = []
    stop_token_ids: Annotated[list[int], Doc(description="Extra token ids that end the completion.")] = []
    ignore_eos: Annotated[bool, Doc(description="Keep going past eos (benchmarks).")] = False
    seed: Annotated[int | None, Doc(description="Per-request RNG seed; same seed, same tokens.")] = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("SamplingParams.stop must not contain an empty string")


class GenerationRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One prompt (already tokenised) to complete."""

    request_id: Annotated[str, Doc(description="Caller's id; unique among in-flight requests.")]
    prompt_ids: Annotated[list[int], Doc(description="Prompt token ids (the engine adds nothing).")]
    params: Annotated[SamplingParams, Doc(description="Sampling parameters.")] = msgspec.field(
        default_factory=SamplingParams
    )
    session_id: Annotated[
        str,
        Doc(
            description="Keep this sequence's KV cache after it finishes, under this key: a later request of the "
            "same session whose prompt extends the cached tokens prefills only the new ones. '' keeps nothing; "
            "the caller releases the session when its episode (or sample) ends."
        ),
    ] = ""


class Timings(msgspec.Struct, kw_only=True):
    """Wall-clock timestamps (unix seconds) of one request, and its time from queue to finish."""

    queued_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    generate_s: float = 0.0


class GenerationResult(msgspec.Struct, kw_only=True):
    """A finished (or aborted) request."""

    request_id: str
    prompt_ids: list[int]
    completion_ids: Annotated[list[int], Doc(description="Sampled ids, including the eos/stop tokens.")]
    logprobs: Annotated[list[float], Doc(description="Log-prob of each sampled id under the processed distribution.")]
    segments: Annotated[
        list[tuple[int, int]], Doc(description="Run-length (policy_version, n_tokens) over completion_ids.")
    ]
    finish_reason: FinishReason
    timings: Timings = msgspec.field(default_factory=Timings)
    routes: Annotated[
        bytes,
        Doc(
            description="MoE models: the experts each forwarded token (prompt + completion but the last) was routed "
            "to, uint8 [token, layer, k] (slipstream.engine.moe); empty for a dense model or an engine that keeps none."
        ),
    ] = b""
    routes_per_token: Annotated[int, Doc(description="Entries of `routes` per token (layers x k); 0 without.")] = 0

    @property
    def policy_versions(self) -> list[int]:
        """The version of every completion token (segments expanded)."""
        return [v for v, n in self.segments for _ in range(n)]


@runtime_checkable
class Engine(Protocol):
    """What a rollout worker needs from an inference engine."""

    @property
    def policy_version(self) -> int:
        """Version of the weights the next sampled token will use."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None:
        """Abort what is in flight (results come back with finish_reason 'abort') and release resources."""
        ...

    async def generate(self, request: GenerationRequest) -> GenerationResult: ...

    def apply_weights(self, version: int, tensors: Mapping[str, Tensor]) -> None:
        """Queue new weights (state_dict names); they take effect between two decode steps.

        Names, shapes and dtypes are checked here and a mismatch raises ValueError naming the
        tensor; nothing is queued then and `policy_version` stays as it was.
        """
        ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def state_dict(self) -> Mapping[str, Any]: ...

    def release(self, session_id: str) -> None:
        """Drop a session's kept KV cache (unknown ids are ignored); engines that keep none do nothing."""
        ...

    def stats(self) -> dict[str, float]: ...


@runtime_checkable
class RemoteWeights(Protocol):
    """An engine whose parameters live in another process (HttpEngine): it describes them.

    Callers that only need names, shapes and dtypes (casting a fetched version before
    `apply_weights`) use `param_specs` instead of `named_parameters`, which for such an engine
    means downloading every tensor.
    """

    def param_specs(self) -> Mapping[str, ParamSpec]: ...
