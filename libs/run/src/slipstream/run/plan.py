"""What a run is: the plan it trains, the summary it ends with, and every service's config from the plan.

`TrainingPlan` is the single description of a run that `slipstream demo`, `slipstream train
RUN.toml` (through `slipstream.run.runfile`), `slipstream bench async` and the e2e tests share;
`service_env` renders it as the `SLIPSTREAM_<SECTION>__<FIELD>` variables every pipeline service
reads (each service reads only the sections it has), so the local stack, Tilt and the cluster
overlay configure services from one place. Pure data: nothing here starts a process.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

SFT_SET = "learner-sft-set.jsonl"
"""The learner's SFT export in a local run's directory (beside its outcome log), with `plan.sft_export`."""


class TrainingPlan(msgspec.Struct, kw_only=True):
    """What one run trains, and how big it is. Defaults are the demo's."""

    env: str = "reverse"
    env_options: dict[str, Any] = {}
    preset: str = "tiny"
    seed: int = 0
    sft_steps: int = 90
    sft_batch: int = 32
    sft_lr: float = 3e-3
    sft_target_accuracy: float = 0.0
    """> 0: the warm-start stops once greedy accuracy on train-split probe tasks reaches this
    (sft_steps is then a cap), so every seed starts RL at the same competence (0: run sft_steps)."""
    sft_check_every: int = 2
    """Supervised steps between two probes of the warm-start's target (a multi-turn probe costs more)."""
    sft_settle_steps: int = 0
    """With a target missed at sft_steps: up to this many more steps at the final lr, still probing."""
    sft_target_sampled: float = 0.0
    """> 0 (with a target): the stop also needs the probe's expected sampled success at the rollout
    temperature (teacher-forced: how often sampling replays the teacher's clean episodes) to reach this."""
    sft_pool_tasks: int = 0
    """> 0: the warm-start trains epochs over the examples of this many train tasks (an expert whose
    episodes are costly to play, e.g. sandboxed) instead of new tasks for every batch (0)."""
    sft_from: str = ""
    """An SFT set (the learner's `sft_export_path` file of an earlier run, or that run's directory) the
    warm-start trains on instead of the env's references or scripted expert: rejection-sampling
    fine-tuning (libs/supervised sft_set.py); "" = the env's own examples."""
    sft_copy_steps: int = 0
    """Steps of the dense copy curriculum before the warm-start (libs/supervised copying.py): the
    induction heads a from-scratch model needs to copy from an arbitrary distance (0: none)."""
    sft_copy_rows: int = 0
    """Copy-curriculum rows added to every warm-start batch, so those heads are kept (0: none)."""
    sft_drill_rows: int = 0
    """The env's skill-drill rows added to every warm-start batch (`Environment.drill_texts`; recall:
    reading a value back from a summary), a skill the teacher's episodes need but rarely show (0: none)."""
    group_size: int = 8
    groups_per_step: int = 8
    task_sampler: str = "off"
    """The task source's `[tasks] sampler`: "pass_rate" serves again the tasks whose latest group was
    informative and retires those solved every time (services/task-source sampler.py); "off": all fresh."""
    screen_target: float = 0.0
    """The rollout workers' `[worker] screen_target`: > 0 skips most tasks whose group is predicted to
    be uniform before sampling it (services/rollout-worker screen.py); 0: off."""
    max_staleness: int = 2
    max_steps: int = 60
    lr: float = 5e-4
    loss: str = "grpo"
    loss_constant: float = 256.0
    kl_coef: float = 0.0
    """[loss] kl_coef: > 0 adds the KL penalty to the frozen reference, the weights RL starts from (0: off)."""
    kl_estimator: str = "k3"
    """[loss] kl_estimator: k1, k2 or k3 (slipstream.rl.kl)."""
    substeps: int = 1
    """[learner] substeps: optimizer updates per batch, each against the recorded behaviour log-probs."""
    loss_options: dict[str, Any] = {}
    """Any other [loss] field by name (off_policy_mask, mask_low, mask_high, kimi_alpha, kimi_beta, kimi_tau,
    clip_low, ...), checked against slipstream.rl's LossConfig when a run file loads; {}: the defaults."""
    temperature: float = 0.7
    max_tokens: int = 8
    worker_max_batch: int = 64
    worker_tasks_in_flight: int = 16
    heldout_tasks: int = 256
    heldout_samples: int = 4
    """Samples per held-out task at the rollout temperature (the headline accuracy is their mean)."""
    eval_every: int = 0
    """Held-out eval on the latest version every N versions during the run (0: before and after only)."""
    train_eval_tasks: int = 0
    """Train-split tasks also evaluated (sampled and greedy) at every held-out eval, on the same footing
    as the held-out ones, so train vs held-out shows memorisation (0: not measured)."""
    eval_suites: dict[str, int] = {}
    """Eval suites beside the run's env, {env: tasks} (an eval-only env such as `humaneval`: its first N
    problems): played by the same harness with the run's model at every held-out eval, greedy and
    sampled (pass@1 in the summary's `suites_before` / `suites_after`), and judged on every version
    by the eval-gate, reported per env but kept out of its promotion decision ({}: none)."""
    timeout_s: float = 900.0
    stall_timeout_s: float = 0.0
    """> 0: a run whose learner takes no step for this long (every group's rewards equal, say: a
    warm-start too weak or too sure for any reward to differ) ends there, as a failed run that still
    evaluates its last version, instead of idling to `timeout_s` with no figures (0: off)."""
    model: str = ""
    """A named pretrained model (`smollm2-135m`) or a local Hugging Face model directory (an absolute
    path: `[model] path`, `--model PATH`): trained as is (no warm-start), with the settings below."""
    lora_rank: int = 0
    """> 0: train LoRA adapters of this rank only (every service gets `[model] lora_*`)."""
    lora_alpha: float = 16.0
    rollout_dtype: str = "float32"
    """[model] dtype of the rollout workers and the held-out evaluator (bfloat16 for a real model)."""
    learner_autocast: str = ""
    """[learner] autocast: "bfloat16" trains fp32 master weights with bf16 matmuls."""
    micro_batch: int = 16
    device: str = "cpu"
    """[model] device of every model-holding service: cpu, cuda or auto (cuda when present)."""
    max_seq_len: int = 0
    """KV-cache length of the workers' and the evaluator's engines; 0 = the engine's default (<= 2048)."""
    tool_service_replicas: int = 0
    """tool-service replicas serving the env's tools (`[replicas] tool-service`); 0: tools run in the workers."""
    subagent_pool_replicas: int = 0
    """Replicas of the frozen sub-agent pool (`[replicas] subagent-pool`), pinned to `subagent_pin_version`;
    the workers then send frozen sub-agents there over NATS. 0: they run in the workers on a frozen copy."""
    subagent_pin_version: int = 0
    """The weight version the pool serves (0: the weights the services start from, a demo's warm-started model)."""
    endpoint: dict[str, Any] = {}
    """[endpoint] of the rollout workers: their OpenAI-compatible, recording endpoint (the fields of
    libs/serve `ServeConfig`: enabled, host, port, model_name, renderer, ...); {}: closed."""
    engine: dict[str, Any] = {}
    """[engine] of the rollout workers (the fields of libs/engine `EngineBackend`: type "torch" | "http" |
    "vllm", url, vllm_python, ...); {}: the in-process torch engine."""
    summary: dict[str, Any] = {}
    """Context restarts of the workers' episodes (and of the held-out evals and the warm-start's expert):
    the fields of libs/harness `SummaryConfig` (enabled, mode "summary" | "truncate", min_tokens,
    max_tokens, summary_tokens, max_summaries, request, stop, restart_template); {}: none."""
    sample_weighting: str = "token"
    """[learner] sample_weighting: "token" (each link of a chain weight 1) or "episode" (each link 1/N)."""
    reward_schedule: dict[str, dict[str, Any]] = {}
    """[learner] reward_schedule: component name -> {init, final, anneal_steps, shape, start_step}, the
    learner's weight λ of that score component by step (slipstream.rl.schedule); {}: every component at 1."""
    toggle: dict[str, Any] = {}
    """[learner] toggle: {enabled, period, rho, accuracy}, Toggle's budget phases (slipstream.rl.toggle);
    {}: off, every answer trains with its scored reward."""
    router_replay: bool = False
    """[learner] router_replay: a MoE model's learner replays the experts the rollouts were routed to."""
    moe_aux_coef: float = 0.01
    """[learner] moe_aux_coef: weight of a MoE model's load-balancing loss (no effect on dense models)."""
    sft_export: bool = False
    """The learner exports its settled train episodes with reward >= sft_export_min_reward to
    `learner-sft-set.jsonl` in the run directory (services/learner sft_export.py), an SFT set for `sft_from`."""
    sft_export_min_reward: float = 1.0
    learner_ranks: int = 1
    """[learner] ranks: > 1 trains on that many Ray rank actors, each publishing its part of every version
    through its own weight-publisher (the local stack starts one per rank)."""


class RunSummary(msgspec.Struct, kw_only=True):
    """What a run did; `slipstream demo --summary-json` writes it."""

    ok: bool
    error: str = ""
    stalled_at_step: int = -1
    """The learner step after which the run stalled (`stall_timeout_s` without a step); -1: it did not."""
    run_dir: str = ""
    plan: TrainingPlan
    heldout_accuracy_before: float = 0.0
    """Held-out accuracy of the policy as it samples (rollout temperature, mean over heldout_samples)."""
    heldout_accuracy_after: float = 0.0
    heldout_greedy_before: float = 0.0
    """Held-out accuracy of greedy (argmax) decoding, for comparison."""
    heldout_greedy_after: float = 0.0
    heldout_reward_before: float = 0.0
    heldout_reward_after: float = 0.0
    heldout_invalid_call_rate_before: float = 0.0
    """Invalid tool calls per tool call on the held-out tasks (sampled), for tool-using envs."""
    heldout_invalid_call_rate_after: float = 0.0
    train_accuracy_before: float = -1.0
    """Train-split accuracy (sampled), when plan.train_eval_tasks > 0; -1 when not measured."""
    train_accuracy_after: float = -1.0
    train_greedy_before: float = -1.0
    """Train-split accuracy of greedy decoding, when plan.train_eval_tasks > 0; -1 when not measured."""
    train_greedy_after: float = -1.0
    heldout_tasks: int = 0
    warmstart: dict[str, Any] = {}
    steps: int = 0
    final_version: int = 0
    versions_published: int = 0
    trajectories: dict[str, Any] = {}
    """published / scored / trained / dropped (by reason) / dead-lettered / left in streams."""
    spanning_versions: int = 0
    """Trajectories whose tokens were sampled under two or more policy versions (mid-rollout refresh)."""
    weights: dict[str, Any] = {}
    weight_applies: dict[str, list[dict[str, Any]]] = {}
    """Per rollout worker (read from its /readyz before it is stopped), one row per version it applied:
    version, apply_ms (the engine loading it), wait_ms (vLLM: waiting for the requests in flight; None
    for an engine that does not wait), switch_ms (apply call to the engine on it), merge_ms (vLLM + LoRA)."""
    eval_curve: list[dict[str, float]] = []
    steps_log: list[dict[str, Any]] = []
    wall_time_s: float = 0.0
    train_time_s: float = 0.0
    """From the stack being ready to the learner's last step."""
    restarts: dict[str, int] = {}
    """Restarts per service by the local supervisor (0 for each service that never crashed)."""
    supervisor_events: list[dict[str, Any]] = []
    """What the supervisor saw and did: crashed / restarted / finished / gave_up, per service, with times."""
    drain_timeouts: list[str] = []
    """Services that, stopped after the run had taken all its steps, closed with work still in flight
    (exit 3, "drain incomplete"): rollouts past the last step, dropped by design, not a failure."""
    train_invalid_call_rate_before: float = -1.0
    """Invalid tool calls per tool call on the train-split tasks (sampled); -1 when not measured."""
    train_invalid_call_rate_after: float = -1.0
    heldout_tool_calls_before: float = 0.0
    """Tool calls per held-out episode (sampled): a falling invalid-call rate means little if calls stop."""
    heldout_tool_calls_after: float = 0.0
    heldout_metrics_before: dict[str, float] = {}
    """The env's own figures on the held-out episodes (sampled), e.g. search's final_answer_found,
    output_recall, traj_recall, f1, prune_accuracy, tool_calls_per_turn, turns_per_episode."""
    heldout_metrics_after: dict[str, float] = {}
    train_metrics_before: dict[str, float] = {}
    """The same figures on the train-split tasks, when plan.train_eval_tasks > 0."""
    train_metrics_after: dict[str, float] = {}
    context_before: dict[str, float] = {}
    """Per sampled episode, held-out and train: tokens over all links, sampled tokens, context restarts."""
    context_after: dict[str, float] = {}
    suites_before: dict[str, dict[str, float]] = {}
    """Per eval suite (plan.eval_suites): pass@1 sampled (mean over heldout_samples at the rollout
    temperature) and greedy, mean reward, tasks, invalid-call rate, tool calls per episode."""
    suites_after: dict[str, dict[str, float]] = {}


def service_env(plan: TrainingPlan, model_dir: Path, staging_dir: Path, outcomes: Path) -> dict[str, str]:
    """Config of every pipeline service on the local stack, as SLIPSTREAM_<SECTION>__<FIELD> variables:
    the run's knobs (`run_env`) plus this machine's paths (version 0's model, the staging directory
    the learner and publisher share, the learner's outcomes file) and one torch thread per process.

    One environment for all: each service reads only the sections it has.
    """
    sft = {"SLIPSTREAM_LEARNER__SFT_EXPORT_PATH": str(outcomes.parent / SFT_SET)} if plan.sft_export else {}
    return {
        **sft,
        "SLIPSTREAM_MODEL__PATH": str(model_dir),
        "SLIPSTREAM_MODEL__THREADS": "1",
        "SLIPSTREAM_LEARNER__STAGING_DIR": str(staging_dir),
        "SLIPSTREAM_LEARNER__OUTCOMES_PATH": str(outcomes),
        "SLIPSTREAM_PUBLISHER__STAGING_DIR": str(staging_dir),
        **run_env(plan),
    }


def run_env(plan: TrainingPlan) -> dict[str, str]:
    """The run's knobs for every service, with nothing that depends on where it runs (no paths):
    what the dev overlay's `run.env` and Tilt's local mode carry, rendered from a run file."""
    env_options = json.dumps({plan.env: plan.env_options}) if plan.env_options else ""
    env = {
        "SLIPSTREAM_MODEL__DEVICE": plan.device,
        "SLIPSTREAM_MODEL__LORA_RANK": str(plan.lora_rank),
        "SLIPSTREAM_MODEL__LORA_ALPHA": str(plan.lora_alpha),
        "SLIPSTREAM_LEARNER__MICRO_BATCH": str(plan.micro_batch),
        "SLIPSTREAM_LEARNER__AUTOCAST": plan.learner_autocast,
        # Versions travel in the rollout dtype: a bf16 worker needs only bf16 weights.
        "SLIPSTREAM_LEARNER__WEIGHTS_DTYPE": plan.rollout_dtype,
        # learner
        "SLIPSTREAM_LEARNER__MAX_STEPS": str(plan.max_steps),
        "SLIPSTREAM_LEARNER__GROUPS_PER_STEP": str(plan.groups_per_step),
        "SLIPSTREAM_LEARNER__MAX_STALENESS": str(plan.max_staleness),
        "SLIPSTREAM_LEARNER__LR": str(plan.lr),
        "SLIPSTREAM_LEARNER__SAMPLING_TEMPERATURE": str(plan.temperature),
        "SLIPSTREAM_LEARNER__CHECKPOINT_EVERY": "1",
        "SLIPSTREAM_LEARNER__SEED": str(plan.seed),
        "SLIPSTREAM_LEARNER__SAMPLE_WEIGHTING": plan.sample_weighting,
        "SLIPSTREAM_LOSS__TYPE": plan.loss,
        "SLIPSTREAM_LOSS__LOSS_CONSTANT": str(plan.loss_constant),
        # task-source
        "SLIPSTREAM_TASKS__ENVS": json.dumps([plan.env]),
        "SLIPSTREAM_TASKS__GROUP_SIZE": str(plan.group_size),
        "SLIPSTREAM_TASKS__GROUPS_PER_STEP": str(plan.groups_per_step),
        "SLIPSTREAM_TASKS__MAX_STALENESS": str(plan.max_staleness),
        "SLIPSTREAM_TASKS__MAX_STEPS": str(plan.max_steps),
        "SLIPSTREAM_TASKS__SEED": str(plan.seed),
        "SLIPSTREAM_TASKS__LEARNER_CHECKPOINT_EVERY": "1",
        # rollout-worker
        "SLIPSTREAM_WORKER__TEMPERATURE": str(plan.temperature),
        "SLIPSTREAM_WORKER__MAX_TOKENS": str(plan.max_tokens),
        "SLIPSTREAM_WORKER__MAX_SEQ_LEN": str(plan.max_seq_len),
        "SLIPSTREAM_WORKER__MAX_BATCH": str(plan.worker_max_batch),
        "SLIPSTREAM_WORKER__MAX_TASKS_IN_FLIGHT": str(plan.worker_tasks_in_flight),
        # eval-gate: the suite is the run's environment, with the same options as training
        "SLIPSTREAM_GATE__ENVS": json.dumps([plan.env, *plan.eval_suites]),
    }
    if plan.eval_suites:
        # The suites are judged on every version beside the run's env, but only reported: the
        # promotion decision rests on the run's own env.
        env["SLIPSTREAM_GATE__SUITE_SIZES"] = json.dumps(plan.eval_suites)
        env["SLIPSTREAM_GATE__REPORT_ONLY"] = json.dumps(list(plan.eval_suites))
    if plan.screen_target > 0:
        env["SLIPSTREAM_WORKER__SCREEN_TARGET"] = str(plan.screen_target)
    if plan.task_sampler != "off":
        # Only when on, so run files without it render as before.
        env["SLIPSTREAM_TASKS__SAMPLER"] = plan.task_sampler
    if plan.reward_schedule:
        env["SLIPSTREAM_LEARNER__REWARD_SCHEDULE"] = json.dumps(plan.reward_schedule, sort_keys=True)
    env.update(loss_env(plan))
    if plan.sft_export:
        env["SLIPSTREAM_LEARNER__SFT_EXPORT_MIN_REWARD"] = str(plan.sft_export_min_reward)
    if plan.toggle:
        env["SLIPSTREAM_LEARNER__TOGGLE"] = json.dumps(plan.toggle, sort_keys=True)
    if plan.router_replay:
        env["SLIPSTREAM_LEARNER__ROUTER_REPLAY"] = "true"
    if plan.moe_aux_coef != 0.01:
        env["SLIPSTREAM_LEARNER__MOE_AUX_COEF"] = str(plan.moe_aux_coef)
    if plan.learner_ranks > 1:
        # The publishers' rank and ranks are per process: the local stack sets them (a cluster runs
        # one publisher sidecar per rank, each with its own SLIPSTREAM_PUBLISHER__RANK).
        env["SLIPSTREAM_LEARNER__RANKS"] = str(plan.learner_ranks)
    env.update(summary_env(plan.summary))
    if plan.endpoint:
        env.update(endpoint_env(plan.endpoint))
    if plan.engine:
        env.update(section_env("engine", plan.engine))
    if env_options:
        env["SLIPSTREAM_TASKS__ENV_OPTIONS"] = env_options
        env["SLIPSTREAM_REWARD__ENV_OPTIONS"] = env_options
        env["SLIPSTREAM_WORKER__ENV_OPTIONS"] = env_options
        env["SLIPSTREAM_GATE__ENV_OPTIONS"] = env_options
    if plan.subagent_pool_replicas > 0:
        env["SLIPSTREAM_SUBAGENTS__TRANSPORT"] = "nats"
    if plan.tool_service_replicas > 0:
        # The workers call the env's tools over NATS; the tool-service serves them, built like the workers' env.
        env["SLIPSTREAM_TOOLS__TRANSPORT"] = "nats"
        env["SLIPSTREAM_SERVE__SETS"] = json.dumps([plan.env])
        served = serve_options(plan)
        if served:
            env["SLIPSTREAM_SERVE__OPTIONS"] = json.dumps(served)
    return env


def check_loss(loss: str, kl_coef: float, kl_estimator: str, options: dict[str, Any]) -> None:
    """A ValueError naming the bad key or value when these [loss] settings are not a valid `LossConfig`."""
    from slipstream.rl.config import LossConfig

    fields = {**options, "type": loss, "kl_coef": kl_coef, "kl_estimator": kl_estimator}
    try:
        msgspec.convert(fields, LossConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from None


def loss_env(plan: TrainingPlan) -> dict[str, str]:
    """The KL, substeps and `loss_options` knobs as variables, only those set away from their defaults
    (a default run's environment stays as it was). Strings as text, everything else as JSON."""
    env: dict[str, str] = {}
    if plan.kl_coef:
        env["SLIPSTREAM_LOSS__KL_COEF"] = str(plan.kl_coef)
        env["SLIPSTREAM_LOSS__KL_ESTIMATOR"] = plan.kl_estimator
    if plan.substeps != 1:
        env["SLIPSTREAM_LEARNER__SUBSTEPS"] = str(plan.substeps)
    for key, value in sorted(plan.loss_options.items()):
        env[f"SLIPSTREAM_LOSS__{key.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    return env


def serve_options(plan: TrainingPlan) -> dict[str, Any]:
    """The tool-service's `[serve] options` for the env's tool set, built as the workers build the env.

    Every env's options as they are, except `search`'s: its tool set serves a stored index unless
    given the environment's options under `env` (the same generated corpus and backend); and `code`'s:
    its set is a sandbox host with defaults of its own (the env's `sandbox = "service"` uses it)."""
    if plan.env == "search":
        return {"search": {"env": plan.env_options}}
    if plan.env == "code":
        # The `code` set is the replica's sandbox host: its options are its own (TTL, capacity), not the
        # env's; the episodes' tools run in the workers and send each sandbox operation to the replica.
        return {}
    return {plan.env: plan.env_options} if plan.env_options else {}


def summary_env(summary: dict[str, Any]) -> dict[str, str]:
    """The rollout workers' `[summary]` section as SLIPSTREAM_SUMMARY__<FIELD> variables.

    Lists and booleans as JSON, numbers and strings as text; a string that would read back as
    JSON (a request like "true" or "[...]") is a ValueError naming the key.
    """
    return section_env("summary", summary)


def endpoint_env(endpoint: dict[str, Any]) -> dict[str, str]:
    """The rollout workers' `[endpoint]` (their OpenAI-compatible endpoint) as SLIPSTREAM_ENDPOINT__<FIELD>."""
    return section_env("endpoint", endpoint)


def engine_conflict(plan: TrainingPlan, environ: Mapping[str, str]) -> str:
    """Why the workers could not start with the engine they will build, or "" when they can.

    The engine type is the plan's `[engine] type`, else what the services inherit
    (`SLIPSTREAM_ENGINE__TYPE` in `environ`, e.g. `SLIPSTREAM_ENGINE__TYPE=vllm slipstream demo`),
    else "torch". The task screen reads the policy's log-probs in the worker's own process, which
    only the torch engine has: otherwise every worker would fail in setup, after its engine started.
    """
    engine = str(plan.engine.get("type") or environ.get("SLIPSTREAM_ENGINE__TYPE") or "torch")
    if engine != "torch" and plan.screen_target > 0:
        source = "[engine] type" if plan.engine.get("type") else "SLIPSTREAM_ENGINE__TYPE"
        return (
            f"the task screen (screen_target = {plan.screen_target:g}) needs the torch engine, which reads the "
            f"model's log-probs in the worker's process; {source} is {engine!r}: turn the screen off "
            "(--screen 0, or [rollout] screen_target = 0 in a run file)"
        )
    return ""


def section_env(section: str, fields: dict[str, Any]) -> dict[str, str]:
    """One config section as SLIPSTREAM_<SECTION>__<FIELD> variables (see `summary_env`)."""
    out: dict[str, str] = {}
    for key, value in fields.items():
        if isinstance(value, (bool, list, tuple, dict)):
            text = json.dumps(list(value) if isinstance(value, tuple) else value)
        elif isinstance(value, str):
            s = value.strip()
            if (s and s[0] in "[{") or s in ("true", "false", "null"):
                raise ValueError(f"{section}.{key} = {value!r} would be read back as JSON by the services")
            text = value
        else:
            text = str(value)
        out[f"SLIPSTREAM_{section.upper()}__{key.upper()}"] = text
    return out


def service_overrides(plan: TrainingPlan) -> dict[str, dict[str, str]]:
    """Per-service config on top of `service_env`: the rollout workers and eval-gate sample in
    `plan.rollout_dtype` while the learner keeps fp32 master weights."""
    sampling = {"SLIPSTREAM_MODEL__DTYPE": plan.rollout_dtype}
    return {"rollout-worker": sampling, "eval-gate": sampling}
