"""`[endpoint]`: the OpenAI-compatible endpoint a serving rollout worker opens (off by default);
and the config of the inference server (`[model]` + `[server]`) that `HttpEngine` drives."""

from __future__ import annotations

from typing import Annotated

import msgspec

from slipstream.engine.source import ModelSource

Doc = msgspec.Meta
# The default patterns of a dissatisfied next user message (matched case-insensitively).
DISSATISFIED = (
    r"\b(wrong|incorrect|not what i (asked|wanted|meant)|doesn'?t work|didn'?t work|try again|that'?s not)\b",
)


class ServeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    enabled: Annotated[bool, Doc(description="Open the OpenAI-compatible endpoint (/v1/chat/completions, ...).")] = (
        False
    )
    host: Annotated[str, Doc(description="Bind address of the endpoint.")] = "127.0.0.1"
    port: Annotated[int, Doc(description="Port of the endpoint; 0 picks a free one.", ge=0, le=65535)] = 8000
    model_name: Annotated[
        str, Doc(description="Model id clients must name (and /v1/models lists); empty = 'slipstream-<model>'.")
    ] = ""
    renderer: Annotated[
        str,
        Doc(
            description="Prompt format and tool-call syntax: a libs/toolcalls renderer ('smollm2', 'qwen2.5', 'tags'); "
            "empty = follow the loaded model (its chat template, or 'tags' without one)."
        ),
    ] = ""
    api_keys: Annotated[
        list[str], Doc(description="Accepted bearer keys; empty accepts any key (each key still names a session).")
    ] = []
    default_max_tokens: Annotated[int, Doc(description="max_tokens of a request that names none.", ge=1)] = 256
    max_tokens_limit: Annotated[int, Doc(description="Largest max_tokens a request may ask for.", ge=1)] = 2048
    session_idle_s: Annotated[
        float, Doc(description="A session with no call for this long is assembled into an episode and stored.", gt=0)
    ] = 300.0
    replay_window: Annotated[
        int, Doc(description="Served calls remembered for replaying SDK retries (and kept for inspection).", ge=1)
    ] = 4096
    env: Annotated[str, Doc(description="`Episode.env` of recorded episodes.")] = "serve"
    # -- feedback and the pending stage (slipstream.serve.feedback / pending / release)
    feedback_deadline_s: Annotated[
        float,
        Doc(description="How long a flushed episode waits for feedback; with none by then it is masked.", gt=0),
    ] = 600.0
    reward_keys: Annotated[
        list[str],
        Doc(description="Signal keys the reward spec reads; only these make an episode releasable. Empty = any key."),
    ] = []
    release_keys: Annotated[
        list[str],
        Doc(description="Hold an episode until it also has a signal of each of these keys (or its deadline)."),
    ] = []
    publish_unrated: Annotated[
        bool,
        Doc(description="Publish episodes with no feedback at the deadline too (for a reward spec with defaults)."),
    ] = False
    group_size: Annotated[
        int, Doc(description="Released episodes are published in groups of this many (the learner's group).", ge=1)
    ] = 8
    group_wait_s: Annotated[
        float,
        Doc(
            description="Publish a smaller group once its oldest member has waited this long; 0 = only full groups.",
            ge=0,
        ),
    ] = 0.0
    group_timeout_s: Annotated[
        float,
        Doc(
            description=(
                "A prompt group (one group key: an n > 1 call, or calls sent with x-slipstream-group) not complete "
                "this long after its first member became ready is released smaller, with the members that are."
            ),
            gt=0,
        ),
    ] = 600.0
    followup_signal: Annotated[
        str, Doc(description="Implicit signal (value 1) on a call when its session's next call arrives; '' = off.")
    ] = "followed_up"
    dissatisfied_signal: Annotated[
        str,
        Doc(description="Implicit signal on a call: 1 when the next user message matches a pattern, else 0; '' = off."),
    ] = "dissatisfied"
    dissatisfied_patterns: Annotated[
        list[str], Doc(description="Regexes (case-insensitive) that mark a next user message as dissatisfied.")
    ] = msgspec.field(default_factory=lambda: list(DISSATISFIED))
    feedback_retention_s: Annotated[
        float, Doc(description="How long call ids and released episodes stay resolvable for feedback.", gt=0)
    ] = 86400.0
    # -- admission (near on-policy)
    max_version_lag: Annotated[
        int,
        Doc(
            description="Answer 429 while the learner's newest version is over this ahead of the served one; 0 = off.",
            ge=0,
        ),
    ] = 2
    retry_after_s: Annotated[
        float, Doc(description="Retry-After of a 429 from admission control, in seconds.", gt=0)
    ] = 1.0


class InferenceSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`[server]` of the inference server (`python -m slipstream.serve.inference`)."""

    host: Annotated[str, Doc(description="Bind address; 0.0.0.0 in a pod (keep it inside the cluster network).")] = (
        "127.0.0.1"
    )
    port: Annotated[int, Doc(description="Port; 0 picks a free one (printed on start).", ge=0, le=65535)] = 8100
    max_batch: Annotated[int, Doc(description="Engine slots: completions decoded together in one batch.", ge=1)] = 32
    max_seq_len: Annotated[
        int, Doc(description="Longest prompt + completion; 0 = the model's (at most 2048).", ge=0)
    ] = 0
    recompute_kv_on_update: Annotated[
        bool, Doc(description="Recompute running rows' KV caches under new weights (default keeps them).")
    ] = False
    speculative_tokens: Annotated[
        int,
        Doc(
            description="Speculative decoding: draft this many tokens per step with the model's MTP modules "
            "(needs weights with mtp_depth >= it; the sampled distribution is unchanged); 0 = off.",
            ge=0,
        ),
    ] = 0
    max_body_mb: Annotated[
        int, Doc(description="Largest request body in MiB (a full weight version travels as one).", ge=1)
    ] = 4096
    apply_timeout_s: Annotated[
        float, Doc(description="Longest wait for an uploaded version to be copied in before a 504.", gt=0)
    ] = 120.0


class InferenceServerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The inference server: which model it serves and how."""

    model: Annotated[
        ModelSource, Doc(description="Initial weights (version 0), tokenizer, dtype, device, threads; LoRA rank.")
    ] = msgspec.field(default_factory=ModelSource)
    server: Annotated[InferenceSection, Doc(description="Socket, batch and weight-update limits.")] = msgspec.field(
        default_factory=InferenceSection
    )
