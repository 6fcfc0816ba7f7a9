"""Configuration of the learner service: one typed class on `ServiceConfig`.

`slipstream.runtime.base.ServiceConfig` holds the shared sections ([service], [bus], [store],
[telemetry]), each owned by its lib; this module adds the service's own.

Resolved by `slipstream.runtime.config` from defaults, a TOML file (`--config`),
`SLIPSTREAM_<SECTION>__<FIELD>` variables and `--section.field` flags, in that order. The
`[learner]` section is this service's own; `[model]` (slipstream.engine) and `[loss]`
(slipstream.rl) are shared with the other services that load the policy or compute the loss.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import msgspec

from slipstream.engine.source import ModelSource
from slipstream.rl import LossConfig
from slipstream.rl.schedule import ComponentSchedule, check_schedule
from slipstream.rl.toggle import ToggleConfig
from slipstream.runtime.base import ServiceConfig
from slipstream.trust.config import ProvenanceConfig

Doc = msgspec.Meta
DEFAULT_STEP_MEANS = (
    "critical_steps",
    "total_steps",
    "subagents",
    "subagents_finished",
    "parallel_turns",
    "parallel_agents",
    "summaries",
    "policy_summaries",
    "truncations",
    "summary_context_tokens",
    "wall_ms",
)
"""Episode counts averaged per step into `LearnerStep.episode_means`: the swarm env's (issue 15; `wall_ms`,
an episode's wall clock with its sub-agents wherever they ran, is issue 32's latency of the training
rollouts) and the context restarts' (issue 33: how often the policy summarised of its own accord, and at
what context size)."""
WeightsDtype = Literal["", "float32", "bfloat16", "float16"]
AutocastDtype = Literal["", "bfloat16"]


class LearnerSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The `[learner]` section: intake, optimizer, hand-off and checkpoint knobs."""

    max_steps: Annotated[int, Doc(description="Optimizer steps to run in total (across restarts); 0 = forever.")] = 0
    groups_per_step: Annotated[int, Doc(description="Complete, valid groups consumed by one optimizer step.")] = 4
    max_staleness: Annotated[
        int,
        Doc(description="Drop a trajectory whose oldest token is over this many versions behind; 0 = synchronous."),
    ] = 2
    lr: Annotated[float, Doc(description="AdamW learning rate.")] = 1e-4
    weight_decay: Annotated[float, Doc(description="AdamW decoupled weight decay.")] = 0.0
    betas: Annotated[tuple[float, float], Doc(description="AdamW betas (beta1, beta2); JSON list on env/CLI.")] = (
        0.9,
        0.99,
    )
    adam_eps: Annotated[float, Doc(description="AdamW epsilon.")] = 1e-8
    grad_clip: Annotated[float, Doc(description="Clip the global gradient norm to this; 0 = no clipping.")] = 1.0
    sampling_temperature: Annotated[
        float,
        Doc(description="Temperature the workers sample with; log-probs are recomputed under it so ratios start at 1."),
    ] = 1.0
    normalize_std: Annotated[
        bool, Doc(description="Divide group advantages by the group's reward std (off: Dr. GRPO / Composer 2).")
    ] = False
    sample_weighting: Annotated[
        Literal["token", "episode"],
        Doc(
            description="Weight of an episode's samples: 'token' (1 each; every sampled token counts once, "
            "so cutting an episode changes nothing) or 'episode' (1/N per agent; see slipstream.rl.credit)."
        ),
    ] = "token"
    uniform_tol: Annotated[
        float, Doc(description="A group whose reward spread (max - min) is at most this is dropped as uniform_group.")
    ] = 0.0
    reward_schedule: Annotated[
        dict[str, ComponentSchedule],
        Doc(
            description="Component name -> its weight λ by learner step ([learner.reward_schedule.<name>] with init, "
            "final, anneal_steps, shape, start_step): the reward trained on is reward + sum_c (λ_c - 1)·component_c "
            "(slipstream.rl.schedule). Unscheduled components keep weight 1; empty = the scored reward as is."
        ),
    ] = {}
    toggle: Annotated[
        ToggleConfig,
        Doc(
            description="Toggle's budget control ([learner.toggle] enabled, period, rho, accuracy): in budget phases "
            "a correct answer longer than its task's frozen budget trains with reward 0 (slipstream.rl.toggle)."
        ),
    ] = msgspec.field(default_factory=ToggleConfig)
    step_means: Annotated[
        list[str],
        Doc(
            description="Episode counts (Episode.counts) averaged over each step's trained episodes into "
            "LearnerStep.episode_means (a count no episode of the step has is left out; where some have it, "
            "the others count 0); every score component is averaged too, as 'component.<name>'."
        ),
    ] = msgspec.field(default_factory=lambda: list(DEFAULT_STEP_MEANS))
    micro_batch: Annotated[
        int, Doc(description="Trajectories per forward pass; gradients accumulate over a step's micro-batches.")
    ] = 16
    substeps: Annotated[
        int,
        Doc(
            description="Optimizer updates per batch (Context-1 takes 4): each recomputes the log-probs under the "
            "weights the ones before produced, its ratio against the recorded behaviour log-probs; 1 = one update."
        ),
    ] = 1
    router_replay: Annotated[
        bool,
        Doc(
            description="MoE models: recompute log-probs with the experts the engine routed each token to (the "
            "routes recorded in the episode) instead of the learner's own top-k; tokens without routes route "
            "themselves. No effect on dense models."
        ),
    ] = False
    moe_aux_coef: Annotated[
        float,
        Doc(
            description="MoE models: weight of the load-balancing auxiliary loss (slipstream.engine.moe, 1.0 at "
            "uniform routing) added to the policy loss; 0 = off. No effect on dense models."
        ),
    ] = 0.01
    mtp_distill_weight: Annotated[
        float,
        Doc(
            description="Weight of the MTP draft modules' self-distillation loss (KL to the main head at the shifted "
            "position, slipstream.engine.mtp_distill) added to every micro-batch's RL loss; 0 = off. Needs a model "
            "with mtp_depth > 0 and ranks = 1; the main model's gradient is unchanged by it (the teacher is detached)."
        ),
    ] = 0.0
    checkpoint_every: Annotated[
        int,
        Doc(
            description="Commit a checkpoint (and ack its trajectories) at every step that is a multiple of N; "
            "0 = only at stop. A paced task source must know N (it counts the held acks)."
        ),
    ] = 10
    commit_when_idle_s: Annotated[
        float,
        Doc(
            description="Also commit when steps are uncommitted and no batch has been ready for this long: a valve "
            "for task sources that do not discount the held acks; 0 = never."
        ),
    ] = 0.0
    keep_checkpoints: Annotated[
        int, Doc(description="Committed checkpoints kept in the object store (older ones are deleted).")
    ] = 3
    group_timeout_s: Annotated[
        float, Doc(description="Drop a group as incomplete_group when it is not full this long after its first member.")
    ] = 120.0
    staging_dir: Annotated[
        str,
        Doc(
            description="Directory the new weights are staged in for the weight-publisher (shared with it); with "
            "ranks > 1, rank r stages its part of each version into <staging_dir>/rank-<r> for its own publisher."
        ),
    ] = ".slipstream/staging"
    weights_dtype: Annotated[
        WeightsDtype, Doc(description="dtype of the staged weights; empty = the model's own dtype.")
    ] = ""
    autocast: Annotated[
        AutocastDtype,
        Doc(
            description="Run forward/backward under torch.autocast in this dtype while the weights (and AdamW) stay in "
            "[model] dtype: fp32 master weights with bf16 matmuls. Empty = no autocast. Not applied on an x86 CPU "
            "without AVX-512, where torch's bf16 GEMM is several times slower than fp32 (the learner logs it)."
        ),
    ] = ""
    seed: Annotated[int, Doc(description="Seed of the learner's torch and python RNGs on a fresh run.")] = 0
    ack_wait_s: Annotated[
        float,
        Doc(
            description="Override of the `learner` durable's ack_wait (tests, single-service runs); 0 = the subject "
            "table's. Other services provisioning the topology reset it to the table's value."
        ),
    ] = 0.0
    announce_timeout_s: Annotated[
        float, Doc(description="How long start-up waits for the last weights.announce when resuming.")
    ] = 1.0
    lease_ttl_s: Annotated[
        float,
        Doc(
            description="TTL of the run's leader lease in Redis ([service] redis_url), renewed every ttl/3; a standby "
            "takes over this long after the leader died. Unused without a control plane."
        ),
    ] = 10.0
    lease_wait: Annotated[
        bool,
        Doc(
            description="When another learner holds the run's lease: true = wait as a standby and take over when it "
            "goes away; false = exit 1 with a message naming the holder."
        ),
    ] = True
    lease_handover_s: Annotated[
        float,
        Doc(
            description="On stop, keep the lease up to this long while the weight-publisher announces the versions "
            "already staged (it announces only while their learner leads); then release it for a standby."
        ),
    ] = 5.0
    control_timeout_s: Annotated[
        float, Doc(description="Bound on every Redis operation of the control plane; must be below lease_ttl_s.")
    ] = 2.0
    outcomes_path: Annotated[
        str,
        Doc(
            description="JSONL file with one line per settled trajectory (trained at commit, dropped, duplicate), "
            "for audits and tests; empty = off."
        ),
    ] = ""
    sft_export_path: Annotated[
        str,
        Doc(
            description="JSONL file the learner appends its settled train episodes to (trained ones at commit, "
            "uniform groups when dropped) whose reward is >= sft_export_min_reward: a rejection-sampling SFT set "
            "(slipstream.learner.sft_export); empty = off."
        ),
    ] = ""
    sft_export_min_reward: Annotated[
        float, Doc(description="Lowest reward an episode needs to enter the SFT export.")
    ] = 1.0

    ranks: Annotated[
        int,
        Doc(
            description="Training ranks. 1 = the model trains in this process; N > 1 = this process is a Ray driver "
            "that starts N rank actors (torch.distributed, gloo on CPU) training one FSDP2-sharded model, each "
            "step's rows split across them by token-balanced packing."
        ),
    ] = 1
    ray_address: Annotated[
        str,
        Doc(
            description="With ranks > 1: the Ray cluster to join ('auto', 'ray://host:10001'); empty = start a "
            "local Ray with `ranks` CPUs and no dashboard."
        ),
    ] = ""
    rank_start_timeout_s: Annotated[
        float, Doc(description="With ranks > 1: how long to wait for Ray to place every rank actor.")
    ] = 60.0
    rank_timeout_s: Annotated[
        float,
        Doc(
            description="With ranks > 1: how long a rank waits in one collective (the process group's timeout) "
            "before it fails. Bounds how long a hung or unreachable rank can stall the others; a rank whose "
            "process dies is noticed at once. Either way the learner exits 1 and resumes from its checkpoint."
        ),
    ] = 300.0
    rank_resource: Annotated[
        str,
        Doc(
            description="With ranks > 1: a Ray custom resource name template with '{rank}' (e.g. "
            "'slipstream-rank-{rank}'); rank r's actor is then placed on the node that advertises one unit of "
            "that resource for r, next to the weight-publisher configured with rank r. Empty = Ray packs the ranks "
            "wherever CPUs are free."
        ),
    ] = ""
    shared_dir: Annotated[
        str,
        Doc(
            description="With ranks on more than one node: a directory every node mounts at this same path (a "
            "ReadWriteMany volume). Checkpoints pass through it: each rank writes its torch.distributed.checkpoint "
            "shards there and the driver stores them in the object store (and the reverse to resume). Empty = the "
            "system temp directory, which only ranks on the driver's node can see; a rank that cannot see the "
            "directory fails the checkpoint, naming this key."
        ),
    ] = ""

    def __post_init__(self) -> None:
        checks = [
            (self.max_steps >= 0, f"max_steps must be >= 0, got {self.max_steps}"),
            (self.groups_per_step >= 1, f"groups_per_step must be >= 1, got {self.groups_per_step}"),
            (self.max_staleness >= 0, f"max_staleness must be >= 0, got {self.max_staleness}"),
            (self.lr > 0, f"lr must be > 0, got {self.lr}"),
            (self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}"),
            (all(0.0 <= b < 1.0 for b in self.betas), f"betas must be in [0, 1), got {list(self.betas)}"),
            (self.adam_eps > 0, f"adam_eps must be > 0, got {self.adam_eps}"),
            (self.grad_clip >= 0, f"grad_clip must be >= 0, got {self.grad_clip}"),
            (self.sampling_temperature > 0, f"sampling_temperature must be > 0, got {self.sampling_temperature}"),
            (self.uniform_tol >= 0, f"uniform_tol must be >= 0, got {self.uniform_tol}"),
            (self.micro_batch >= 1, f"micro_batch must be >= 1, got {self.micro_batch}"),
            (self.substeps >= 1, f"substeps must be >= 1, got {self.substeps}"),
            (self.moe_aux_coef >= 0, f"moe_aux_coef must be >= 0, got {self.moe_aux_coef}"),
            (self.mtp_distill_weight >= 0, f"mtp_distill_weight must be >= 0, got {self.mtp_distill_weight}"),
            (self.checkpoint_every >= 0, f"checkpoint_every must be >= 0, got {self.checkpoint_every}"),
            (self.commit_when_idle_s >= 0, f"commit_when_idle_s must be >= 0, got {self.commit_when_idle_s}"),
            (self.keep_checkpoints >= 1, f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}"),
            (self.group_timeout_s > 0, f"group_timeout_s must be > 0, got {self.group_timeout_s}"),
            (bool(self.staging_dir), "staging_dir must name a directory"),
            (self.ack_wait_s >= 0, f"ack_wait_s must be >= 0, got {self.ack_wait_s}"),
            (self.announce_timeout_s >= 0, f"announce_timeout_s must be >= 0, got {self.announce_timeout_s}"),
            (self.ranks >= 1, f"ranks must be >= 1, got {self.ranks}"),
            (self.rank_start_timeout_s > 0, f"rank_start_timeout_s must be > 0, got {self.rank_start_timeout_s}"),
            (self.rank_timeout_s > 0, f"rank_timeout_s must be > 0, got {self.rank_timeout_s}"),
            (
                not self.rank_resource or "{rank}" in self.rank_resource,
                f"rank_resource must contain '{{rank}}' (one resource per rank), got {self.rank_resource!r}",
            ),
            (self.lease_ttl_s > 0, f"lease_ttl_s must be > 0, got {self.lease_ttl_s}"),
            (self.lease_handover_s >= 0, f"lease_handover_s must be >= 0, got {self.lease_handover_s}"),
            (
                0 < self.control_timeout_s < self.lease_ttl_s,
                f"control_timeout_s must be in (0, lease_ttl_s={self.lease_ttl_s}), got {self.control_timeout_s}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        check_schedule(self.reward_schedule)
        blank = [name for name in self.step_means if not name.strip()]
        if blank or len(set(self.step_means)) != len(self.step_means):
            raise ValueError(f"step_means must name distinct, non-empty counts, got {self.step_means}")
        if self.rank_resource:
            try:
                self.rank_resource.format(rank=0)
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(
                    f"rank_resource {self.rank_resource!r} is not a template with only '{{rank}}' in braces: {exc!r}"
                ) from None


class LearnerConfig(ServiceConfig, kw_only=True, forbid_unknown_fields=True):
    section_docs: ClassVar[dict[str, str]] = {
        "store": "Object store (local directory or S3): checkpoints, weights.",
    }
    model: Annotated[ModelSource, Doc(description="The policy to train: an HF directory or a seeded preset.")] = (
        msgspec.field(default_factory=ModelSource)
    )
    loss: Annotated[LossConfig, Doc(description="Policy loss: grpo or cispo, clipping, KL, normalisation.")] = (
        msgspec.field(default_factory=LossConfig)
    )
    learner: Annotated[LearnerSection, Doc(description="Intake, optimizer, weight hand-off and checkpoints.")] = (
        msgspec.field(default_factory=LearnerSection)
    )
    provenance: Annotated[
        ProvenanceConfig, Doc(description="The reward-model keys a scored episode must be signed with.")
    ] = msgspec.field(default_factory=ProvenanceConfig)
