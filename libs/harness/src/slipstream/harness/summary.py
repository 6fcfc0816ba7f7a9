"""Self-summarising chains (Composer 2): a long episode continues in a fresh context the model wrote.

When a sample's context reaches the group's threshold, the harness asks the policy for a summary
(an instruction appended as an observation, then `summary_tokens` of room to think and write),
and restarts the context from the task prompt, that summary, the conversation state (how many
summaries so far) and whatever arrived since the policy last spoke (a tool result, a question:
kept verbatim, as token slices of the old link, so it is never re-encoded). The restart is a
context edit: a new sample of the same episode (`edit="summary"`, `branch_of` the link before
it), so the chain's earlier links are never rewritten. The environment does not know: it keeps
the `Thread` it opened, which now continues in the newest link. Works for any multi-turn
environment written against `EpisodeContext`.

Credit needs nothing special, by design of libs/rl `credit.py`: the summary tokens are the
policy's own sampled tokens in the link they end, so the episode's outcome advantage reaches
every sampled token of every link, summaries included; with the default `"token"` sample
weighting a chain of N links trains each sampled token exactly once, so N is never an implicit
weight (`"episode"` weighting gives each link 1/N instead).

The threshold is drawn once per group (a hash of the group id into [min, max] tokens), so the
episodes that share a baseline face the same context budget and their rewards stay comparable.

`mode="truncate"` is the baseline summaries are measured against: at the same threshold the
context restarts from the task prompt, a marker and the last `summary_tokens` tokens of the
conversation (at least everything since the policy last spoke), verbatim, with no summary
written. Both modes carry the same budget across a restart; only what fills it differs.

`policy=True` lets the policy choose *when* to summarise (Composer 2's learned timing): at any turn
it may open a summary with `open` ("<summary>") instead of answering; the harness lets it finish
(up to `summary_tokens`, stopped at `stop`), restarts the context from it exactly as above, and
asks the environment's turn again in the new link. The threshold still applies to a policy that
never summarises: past it `mode` decides (a summary it is asked for, or truncation, which makes a
late or missing summary costly). The turn at which each summary opened is counted
(`summary_at_turn_<k>`, `policy_summaries`, `summary_context_tokens`), and so is each restart the
threshold forced (`threshold_at_turn_<k>`): the distribution of *when* against the fixed rule.

`train_summaries=False` is the control that isolates what RL teaches through the summaries: the
summary tokens (the policy's own and the requested ones) get loss mask 0 in training rollouts, so
the outcome reward trains everything but them (evaluations keep the mask as sampled).

This module holds the configuration and the pure rules (the threshold, the restart text); the
context that runs a chain over an episode's recorder is summarising.py.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal

import msgspec

Doc = msgspec.Meta

DEFAULT_REQUEST = (
    "\n[Context limit reached. Summarise your work so far for yourself: the facts you found that the "
    "answer needs, your plan, and what remains to do. End with </summary>.]\n<summary>"
)
DEFAULT_RESTART = "\n[Summary {n} of your earlier work]\n{summary}\n[Summaries so far: {n}]\n"
TRUNCATED = "\n[truncated]\n"
MODES = ("summary", "truncate")


class SummaryConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """When and how an episode summarises itself (`[rollout.summary]` in a run file)."""

    enabled: Annotated[bool, Doc(description="Summarise when a context reaches the threshold.")] = False
    mode: Annotated[
        Literal["summary", "truncate"],
        Doc(
            description="'summary': the policy writes a summary and the context restarts from it; 'truncate' "
            "(the baseline): the context restarts from the task and its last summary_tokens tokens, no summary."
        ),
    ] = "summary"
    min_tokens: Annotated[int, Doc(description="Lowest context threshold drawn for a group, in tokens.")] = 1024
    max_tokens: Annotated[int, Doc(description="Highest context threshold drawn for a group, in tokens.")] = 1024
    summary_tokens: Annotated[int, Doc(description="Room the policy gets to write one summary, in tokens.")] = 256
    max_summaries: Annotated[
        int, Doc(description="Summaries per episode; past it the context just grows (and may end the episode).")
    ] = 8
    request: Annotated[str, Doc(description="The instruction appended (as an observation) to ask for a summary.")] = (
        DEFAULT_REQUEST
    )
    stop: Annotated[tuple[str, ...], Doc(description="Stop strings that end a summary.")] = ("</summary>",)
    policy: Annotated[
        bool,
        Doc(
            description="The policy may open a summary itself (its turn begins with `open`) at any turn, before "
            "the threshold; the threshold then applies `mode` to a context that reaches it unsummarised."
        ),
    ] = False
    open: Annotated[str, Doc(description="How the policy opens a summary of its own (policy=True).")] = "<summary>"
    train_summaries: Annotated[
        bool,
        Doc(
            description="Train on summary tokens (the default). False: loss mask 0 on them in training rollouts "
            "(the control that isolates what RL teaches through the summaries)."
        ),
    ] = True
    restart_template: Annotated[
        str,
        Doc(
            description="What follows the task prompt in a restarted context; {summary} is the summary and {n} "
            "the number of summaries so far (the conversation state)."
        ),
    ] = DEFAULT_RESTART

    def __post_init__(self) -> None:
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {self.min_tokens} and {self.max_tokens}")
        if self.summary_tokens < 1 or self.max_summaries < 1:
            raise ValueError(
                f"summary_tokens and max_summaries must be >= 1, got {self.summary_tokens} and {self.max_summaries}"
            )
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.policy and not self.open.strip():
            raise ValueError("open must not be empty when policy=True: it is how the policy starts a summary")
        if not self.request.strip():
            raise ValueError("request must not be empty: the policy has to be asked for its summary")
        if "{summary}" not in self.restart_template or "{n}" not in self.restart_template:
            raise ValueError(
                f"restart_template must hold {{summary}} and {{n}} (the summary and the state), got "
                f"{self.restart_template!r}"
            )


def group_threshold(config: SummaryConfig, group_id: str) -> int:
    """The context threshold of every episode of group `group_id`: a hash of the id into [min, max]."""
    span = config.max_tokens - config.min_tokens + 1
    digest = hashlib.blake2b(f"summary-threshold:{group_id}".encode(), digest_size=8).digest()
    return config.min_tokens + int.from_bytes(digest, "little") % span


def restart_text(summary: str, summaries: int, template: str = DEFAULT_RESTART) -> str:
    """What follows the task prompt in a restarted context: the summary and the conversation state."""
    return template.replace("{summary}", summary.strip()).replace("{n}", str(summaries))
