"""Episodes: one attempt at one task by one or more agents, as the engine produced and consumed it.

An episode is made of *samples*. A sample is one contiguous token sequence exactly as the engine
saw it: the prompt ids, then every token after the prompt in order — tokens the agent sampled
(loss mask 1, with their behaviour log-probs and policy versions) interleaved with observation
tokens (tool results, environment text; loss mask 0). A single-turn rollout is one sample. A
context edit (a prune, a summary restart, a sub-agent hand-off) never rewrites a prefix: it starts
a new sample that names the sample and token position it branched from.

The episode also carries the environment's own log of tool calls (`tool_log`), including calls
whose results a later prune hid from the model, so a scorer sees everything.

An episode too big for the bus travels *by reference* (DESIGN: NATS moves messages, the object
store holds bytes): the producer writes the full encoded `Episode` to the object store first, then
publishes a stub — the same `Episode` with every header field set, `samples` and `tool_log` empty,
and `body_ref` naming the stored body (key, size, sha256). A stub is routed, deduplicated and
staleness-checked like any episode; a consumer loads the body before it needs tokens. Scoring
never rewrites the body, so a scored stub points at the same stored object.

v1 producers keep working: `episode_from_trajectory` / `scored_episode_from_v1` turn a
`Trajectory` / `ScoredTrajectory` into a one-sample episode, and consumers of `Episode` /
`ScoredEpisode` admit the v1 messages through them (`codec.UPGRADES`).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import msgspec

from slipstream.schemas.packing import unpack_floats, unpack_ids, unpack_mask
from slipstream.schemas.rollout import PolicySegment, ScoredTrajectory, Timings, Trajectory, Turn

Doc = msgspec.Meta

ToolStatus = Literal["ok", "invalid_tool_call", "infra_error"]
EDITS = ("", "prune", "summary", "handoff")


class Sample(msgspec.Struct, kw_only=True):
    """One contiguous token sequence of one agent, exactly as the engine produced and consumed it."""

    sample_id: Annotated[str, Doc(description="Unique within its episode (globally unique in practice).")]
    agent_id: Annotated[str, Doc(description="Which agent produced it; samples of one agent id share a policy.")] = (
        "policy"
    )
    role: Annotated[
        str, Doc(description="What the sample is: 'policy', 'subagent', 'summary', ... (credit groups by it).")
    ] = "policy"
    trainable: Annotated[
        bool,
        Doc(description="False for frozen agents (sub-agents on a pinned version): kept for audit, never trained."),
    ] = True
    loss_weight: Annotated[
        float,
        Doc(description="Multiplies this sample's token losses (producer's choice; see slipstream.rl.credit)."),
    ] = 1.0
    prompt_len: Annotated[int, Doc(description="Number of prompt tokens at the start of token_ids.")] = 0
    token_ids: Annotated[
        bytes, Doc(description="Prompt + every token after it (sampled and observation), int32 little-endian.")
    ] = b""
    logprobs: Annotated[
        bytes,
        Doc(description="Behaviour log-prob per token after the prompt, float32 LE; 0 for observation tokens."),
    ] = b""
    loss_mask: Annotated[
        bytes,
        Doc(description="uint8 per token after the prompt: 1 = sampled by this agent, 0 = observation / tool result."),
    ] = b""
    segments: Annotated[
        list[PolicySegment],
        Doc(
            description="Run-length policy versions over the tokens after the prompt (observation tokens carry "
            "the version in force when they were appended)."
        ),
    ] = []
    turns: Annotated[
        list[Turn], Doc(description="Spans of token_ids by what they were (policy turn, tool result, ...).")
    ] = []
    branch_of: Annotated[
        str, Doc(description="sample_id this sample continues after a context edit; '' for a root sample.")
    ] = ""
    branch_pos: Annotated[
        int, Doc(description="Token position in the parent sample (index into its token_ids) where it branched.")
    ] = 0
    edit: Annotated[
        str, Doc(description="The context edit that started this sample: 'prune', 'summary', 'handoff' or ''.")
    ] = ""
    finish_reason: Annotated[str, Doc(description="Why this sample ended: 'stop', 'length', 'edit', ...")] = ""
    routes: Annotated[
        bytes,
        Doc(
            description="Mixture-of-experts models: the experts the engine routed each of the first N tokens of "
            "token_ids to, uint8 token-major [token, layer, k] (N * routes_per_token bytes; the tokens after N, "
            "such as the last sampled one, were never forwarded). The learner can replay them (router replay). "
            "Empty for dense models."
        ),
    ] = b""
    routes_per_token: Annotated[int, Doc(description="Bytes of `routes` per token: MoE layers x top-k; 0 = none.")] = 0

    # Convenience views; not part of the wire format.
    def ids(self) -> list[int]:
        return unpack_ids(self.token_ids)

    def behaviour_logprobs(self) -> list[float]:
        return unpack_floats(self.logprobs)

    def mask(self) -> list[int]:
        return unpack_mask(self.loss_mask)

    def completion_len(self) -> int:
        """Tokens after the prompt (sampled and observation)."""
        return len(self.token_ids) // 4 - self.prompt_len

    def n_sampled(self) -> int:
        """Tokens this agent sampled (mask = 1)."""
        return sum(self.loss_mask)

    def versions(self) -> list[int]:
        """Distinct policy versions in sampling order."""
        out: list[int] = []
        for seg in self.segments:
            if not out or out[-1] != seg.policy_version:
                out.append(seg.policy_version)
        return out

    def oldest_version(self) -> int:
        return min((s.policy_version for s in self.segments), default=-1)


class ToolEvent(msgspec.Struct, kw_only=True):
    """One tool call as the environment saw it: the scorer's view, including what a prune hid."""

    sample_id: Annotated[str, Doc(description="The sample whose tokens contain the call.")]
    turn: Annotated[int, Doc(description="Index of the policy turn (model call) within the episode that made it.")] = 0
    call_id: Annotated[str, Doc(description="Id of the call, unique within the episode.")] = ""
    name: Annotated[str, Doc(description="Tool name as the model wrote it (may be unknown for invalid calls).")] = ""
    arguments: Annotated[str, Doc(description="Arguments as JSON text, exactly as the model wrote it.")] = ""
    status: Annotated[
        ToolStatus,
        Doc(
            description="'ok'; 'invalid_tool_call' (the model's fault: bad JSON, unknown tool, wrong arguments); "
            "'infra_error' (backend down, timeout: never the model's fault)."
        ),
    ] = "ok"
    result: Annotated[str, Doc(description="Result text returned to the model (before any truncation shown).")] = ""
    error: Annotated[str, Doc(description="Error text (shown to the model for invalid calls).")] = ""
    latency_s: Annotated[float, Doc(description="Wall time of the call in seconds.")] = 0.0
    hidden: Annotated[bool, Doc(description="A later prune hid this call's result from the model.")] = False
    info: Annotated[
        dict[str, str], Doc(description="Tool-specific extras for scorers (e.g. retrieved chunk ids).")
    ] = {}
    agent_id: Annotated[
        str, Doc(description="The nested agent that made the call (a spawned sub-agent's id); '' = the episode's own.")
    ] = ""


class EpisodeRef(msgspec.Struct, kw_only=True):
    """Where a stub episode's full body lies in the object store (the by-reference form)."""

    key: Annotated[str, Doc(description="Object-store key of the msgpack-encoded full Episode.")]
    size: Annotated[int, Doc(description="Length of the stored body in bytes.")]
    sha256: Annotated[str, Doc(description="Hex sha256 of the stored body; checked on load.")]
    n_samples: Annotated[int, Doc(description="Samples in the stored body.")] = 0
    n_tokens: Annotated[int, Doc(description="Tokens over all samples of the stored body.")] = 0
    oldest_version: Annotated[
        int, Doc(description="Oldest policy version over the body's trainable samples (-1: none), for staleness.")
    ] = -1


class FeedbackSignal(msgspec.Struct, kw_only=True):
    """One signal about a served episode, recorded after the fact (`POST /v1/feedback`, or implicit,
    derived from the user's next turn); a reward spec turns signals into named reward components."""

    key: Annotated[str, Doc(description="What is signalled: 'accepted', 'dissatisfied', 'followed_up', ...")]
    value: Annotated[float | bool | str, Doc(description="The signal's value: a number, a boolean or a label.")]
    source: Annotated[str, Doc(description="Who gave it: 'user', 'implicit', an app or a rater id.")] = "user"
    feedback_id: Annotated[str, Doc(description="Idempotency key: a signal is recorded once per id.")] = ""
    target: Annotated[
        str, Doc(description="What it was posted for: 'completion:<call id>', 'session:<id>' or 'episode:<id>'.")
    ] = ""
    at: Annotated[float, Doc(description="Unix time it was recorded.")] = 0.0


class Episode(msgspec.Struct, kw_only=True):
    """One attempt at one task by one or more agents: what `traj.raw.<env>` carries."""

    SCHEMA: ClassVar[str] = "Episode"
    VERSION: ClassVar[int] = 1

    episode_id: Annotated[str, Doc(description="Globally unique; the idempotency key.")]
    task_id: Annotated[str, Doc(description="The task attempted; with role, the group key for advantages.")]
    env: Annotated[str, Doc(description="Environment name in the environment registry.")]
    run_id: Annotated[str, Doc(description="Training run this episode belongs to.")] = ""
    group_id: Annotated[
        str, Doc(description="Id of this sampling of the task; a redelivered task forms a new group.")
    ] = ""
    group_index: Annotated[int, Doc(description="Index of this episode within its group.")] = 0
    group_size: Annotated[int, Doc(description="Episodes in the group.")] = 1
    split: Annotated[str, Doc(description="'train' or 'heldout' (copied from the task).")] = "train"
    reference: Annotated[
        str, Doc(description="The task's reference answer, for the scorer (never shown to the policy).")
    ] = ""
    samples: Annotated[list[Sample], Doc(description="Token sequences, in the order they were started.")] = []
    tool_log: Annotated[list[ToolEvent], Doc(description="Every tool call, in call order, for scorers.")] = []
    final_text: Annotated[str, Doc(description="The episode's final answer text (what single-turn scorers read).")] = ""
    finish_reason: Annotated[str, Doc(description="'stop', 'length', 'tool_budget', 'error', ...")] = ""
    worker_id: Annotated[str, Doc(description="Rollout worker that produced it.")] = ""
    timings: Annotated[Timings, Doc(description="Wall-clock timestamps of the episode.")] = msgspec.field(
        default_factory=Timings
    )
    metadata: Annotated[dict[str, str], Doc(description="Free-form string tags.")] = {}
    counts: Annotated[
        dict[str, int], Doc(description="Event counts: 'turns', 'tool_calls', 'invalid_tool_call', ...")
    ] = {}
    infra_error: Annotated[
        str, Doc(description="Non-empty: an infrastructure failure spoiled it; never scored as the model's fault.")
    ] = ""
    body_ref: Annotated[
        EpisodeRef | None,
        Doc(description="Set on a by-reference stub: samples/tool_log are empty here and lie in the object store."),
    ] = None
    feedback: Annotated[
        list[FeedbackSignal],
        Doc(description="Signals attached after serving (issue 16), in the order recorded; empty for task rollouts."),
    ] = []

    # Convenience views; not part of the wire format.
    def is_stub(self) -> bool:
        return self.body_ref is not None

    def trainable_samples(self) -> list[Sample]:
        return [s for s in self.samples if s.trainable]

    def oldest_version(self) -> int:
        """Oldest policy version over trainable samples (-1 when none); a stub answers from its ref."""
        if self.body_ref is not None:
            return self.body_ref.oldest_version
        return min((v for s in self.samples if s.trainable and (v := s.oldest_version()) >= 0), default=-1)

    def n_tokens(self) -> int:
        if self.body_ref is not None:
            return self.body_ref.n_tokens
        return sum(len(s.token_ids) // 4 for s in self.samples)

    def n_samples(self) -> int:
        if self.body_ref is not None:
            return self.body_ref.n_samples
        return len(self.samples)

    def sample(self, sample_id: str) -> Sample:
        for s in self.samples:
            if s.sample_id == sample_id:
                return s
        raise KeyError(f"episode {self.episode_id!r} has no sample {sample_id!r}")


class Judgement(msgspec.Struct, kw_only=True):
    """One generative judge's verdict on an episode: its provenance and every rubric's score.

    Scores are normalised to [0, 1]. A rubric the judge could not score (malformed verdicts past
    the retry budget, timeouts, rate limits) has no entry in `scores` and one in `failures`.
    """

    judge: Annotated[str, Doc(description="Name of the judge in the reward-model's config.")]
    model: Annotated[str, Doc(description="Judge model, as sent to its OpenAI-compatible endpoint.")]
    rubric_set: Annotated[str, Doc(description="Rubric set that was sampled from, as 'context@version'.")]
    rubric_ids: Annotated[list[str], Doc(description="The rubrics sampled for this episode, in sampling order.")] = []
    scores: Annotated[dict[str, float], Doc(description="Rubric id -> score in [0, 1], for each rubric scored.")] = {}
    failures: Annotated[
        dict[str, str], Doc(description="Rubric id -> why it could not be scored ('malformed', 'timeout', ...).")
    ] = {}
    aggregate: Annotated[
        float, Doc(description="The rubrics' scores aggregated (mean, median or majority), in [0, 1].")
    ] = 0.0
    aggregation: Annotated[str, Doc(description="How `aggregate` was formed: 'mean', 'median' or 'majority'.")] = ""
    cached: Annotated[int, Doc(description="Rubric verdicts that came from the cache instead of a call.")] = 0
    unscorable: Annotated[str, Doc(description="Non-empty: too few rubrics were scored; the reason.")] = ""


class ScoredEpisode(msgspec.Struct, kw_only=True):
    """An episode with its reward: what `traj.scored.<env>` carries and the learner consumes."""

    SCHEMA: ClassVar[str] = "ScoredEpisode"
    VERSION: ClassVar[int] = 1

    episode: Annotated[Episode, Doc(description="The episode (a stub when it travels by reference).")]
    reward: Annotated[float, Doc(description="Total scalar reward.")]
    components: Annotated[dict[str, float], Doc(description="Named reward components summing to reward.")] = {}
    correct: Annotated[bool, Doc(description="Whether the verifier judged the answer correct.")] = False
    scorer_version: Annotated[str, Doc(description="Scorer name and version that produced the reward.")] = ""
    scored_at: Annotated[float, Doc(description="Unix time of scoring.")] = 0.0
    unscorable: Annotated[
        str,
        Doc(
            description="Non-empty: a part of the reward could not be computed (e.g. 'judge: ...'); the reason. "
            "The learner drops the episode (never a silent 0) and leaves it out of its group's baseline."
        ),
    ] = ""
    judgements: Annotated[
        list[Judgement], Doc(description="Provenance and per-rubric scores of every judge that scored it.")
    ] = []
    key_id: Annotated[
        str,
        Doc(description="Id of the reward-model's ed25519 key that signed this score (16 hex of its sha256)."),
    ] = ""
    ed25519: Annotated[
        str,
        Doc(description="Base64 ed25519 signature over every other field (slipstream.trust.scores); empty: unsigned."),
    ] = ""


# -- v1 compatibility ------------------------------------------------------------------------------


def sample_from_trajectory(t: Trajectory) -> Sample:
    """The one sample of a v1 trajectory; its id is the trajectory id."""
    return Sample(
        sample_id=t.trajectory_id,
        prompt_len=t.prompt_len,
        token_ids=t.token_ids,
        logprobs=t.logprobs,
        loss_mask=t.loss_mask,
        segments=list(t.segments),
        turns=list(t.turns),
        finish_reason=t.finish_reason,
    )


def episode_from_trajectory(t: Trajectory) -> Episode:
    """A v1 `Trajectory` as a one-sample Episode (episode_id = trajectory_id, final_text = completion)."""
    return Episode(
        episode_id=t.trajectory_id,
        task_id=t.task_id,
        env=t.env,
        run_id=t.run_id,
        group_id=t.group_id,
        group_index=t.group_index,
        group_size=t.group_size,
        split=t.split,
        reference=t.reference,
        samples=[sample_from_trajectory(t)],
        final_text=t.completion_text,
        finish_reason=t.finish_reason,
        worker_id=t.worker_id,
        timings=t.timings,
        metadata=dict(t.metadata),
        counts={"turns": max(1, sum(1 for turn in t.turns if turn.role == "policy"))},
    )


def scored_episode_from_v1(s: ScoredTrajectory) -> ScoredEpisode:
    """A v1 `ScoredTrajectory` as a ScoredEpisode around a one-sample episode."""
    return ScoredEpisode(
        episode=episode_from_trajectory(s.trajectory),
        reward=s.reward,
        components=dict(s.components),
        correct=s.correct,
        scorer_version=s.scorer_version,
        scored_at=s.scored_at,
    )


def stub_of(episode: Episode, ref: EpisodeRef) -> Episode:
    """The by-reference form of `episode`: every header field kept, samples and tool log left out."""
    return msgspec.structs.replace(episode, samples=[], tool_log=[], body_ref=ref)
