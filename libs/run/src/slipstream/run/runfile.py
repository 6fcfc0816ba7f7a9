"""The run file: one TOML that describes an experiment, read by the laptop, Tilt and the cluster alike.

    slipstream train examples/arith.toml                 # local stack, live view, summary
    slipstream train examples/arith.toml --print-config  # every service's resolved config
    slipstream up --run examples/arith.toml              # the stack alone, configured by it

Sections (every key optional; what is left out keeps `TrainingPlan`'s default):

    name = "arith"         the run id               seed = 0     task order, held-out set, learner RNG
    timeout_s = 900.0      the local run's budget
    stall_timeout_s = 0.0  > 0: end the run (and evaluate its last version) after this long without a learner step
    [model]      preset ("tiny", "micro", "tiny-moe", "25m"), name (a named pretrained model: "smollm2-135m"),
                 path (a local Hugging Face model directory, relative to the run file; Llama, Qwen2, Qwen3,
                 Mistral), device
                 (cpu | cuda | auto), rollout_dtype, learner_autocast, lora_rank, lora_alpha
    [env]        name, options (the environment's own options, e.g. {max_operand = 19})
    [algorithm]  loss (grpo | cispo | kimi), lr, loss_constant, max_staleness, temperature, kl_coef
                 and kl_estimator (k1 | k2 | k3: the KL penalty to the frozen initial weights, 0 = off),
                 substeps (optimizer updates per batch), loss_options (any other [loss] field:
                 off_policy_mask, mask_low, mask_high, kimi_alpha, kimi_beta, kimi_tau, ...)
    [batch]      group_size, groups_per_step, max_steps, max_tokens, micro_batch, task_sampler ("off" |
                 "pass_rate": the task source serves again tasks whose latest group was informative)
    [warmstart]  sft_steps, sft_batch, sft_lr, sft_target_accuracy, sft_check_every,
                 sft_settle_steps, sft_target_sampled, sft_pool_tasks (epochs over that many tasks'
                 expert episodes), sft_copy_steps, sft_copy_rows (tiny models only; the copy
                 curriculum that gives a model from scratch its induction heads), sft_drill_rows (the
                 env's skill drill in every batch: recall's read-back), sft_from (an SFT
                 set of an earlier run's RL episodes, or that run's directory: rejection-sampling
                 fine-tuning instead of the env's references or expert)
    [eval]       heldout_tasks, heldout_samples, eval_every, train_eval_tasks (train accuracy beside held-out)
    [rollout]    max_batch, tasks_in_flight, max_seq_len (the workers' engines), screen_target (> 0: skip
                 most tasks whose group is predicted uniform before sampling it; services/rollout-worker;
                 the torch engine only: with another [engine] type it is refused when the file loads)
    [rollout.summary]  context restarts (libs/harness summary.py): enabled, mode ("summary": the
                 policy summarises itself; "truncate": the baseline, the context's last tokens),
                 min_tokens / max_tokens (the per-group threshold range), summary_tokens (the budget
                 one summary may use, and what truncation keeps), max_summaries, request, stop,
                 restart_template, policy (the policy may open a summary itself, with `open`, at
                 any turn), train_summaries (false: summary tokens masked from the loss, a control),
                 and loss_weighting ("token" | "episode": the learner's weight of
                 a chain's links). Read by the rollout workers as [summary], the learner's
                 sample_weighting, and the local run's held-out evals and warm-start.
    [learner]    ranks (> 1: the learner trains on that many Ray rank actors, FSDP2, and the local stack
                 starts one weight-publisher per rank, each publishing its rank's part of every version)
    [learner.reward_schedule.<component>]  init, final, anneal_steps, shape, start_step: the learner's
                 weight λ of a named reward component by step (services/learner README, "Reward
                 schedule"); checked by the learner's config when its config is resolved
    [learner.toggle]  enabled, period, rho, accuracy: Toggle's budget phases (slipstream.rl.toggle;
                 services/learner README, "Toggle"), checked the same way
    [learner]    router_replay (true: a MoE model's learner forces the experts the rollouts recorded),
                 moe_aux_coef (weight of its load-balancing loss, default 0.01)
    [learner]    sft_export (true: the learner writes its settled train episodes with reward >=
                 sft_export_min_reward, default 1.0, to learner-sft-set.jsonl in the run directory)
    [endpoint]   the rollout workers' OpenAI-compatible, recording endpoint (on when the table is there):
                 enabled, host, port, model_name, renderer ("" follows the model), api_keys,
                 default_max_tokens, max_tokens_limit, session_idle_s; `slipstream serve RUN.toml`
                 serves [model] with the same settings, without training
    [engine]     the rollout workers' engine (libs/engine `EngineBackend`): type ("torch" | "http" | "vllm":
                 each worker starts a vLLM server of its own from vllm_python, `make vllm-venv`), url,
                 request_timeout_s, weights_timeout_s, vllm_python, vllm_start_timeout_s,
                 vllm_kv_cache_gb, vllm_max_model_len, vllm_enforce_eager, vllm_threads, vllm_args
    [replicas]   rollout-worker, reward-model, eval-gate (the cluster's replica counts); tool-service
                 (> 0: the env's tools run in that many tool-service replicas, locally too)
    [infra]      nats_url, redis_url, store: reuse running servers / an S3 store ("" = start locally)

Loading is strict: an unknown key, or a value of the wrong type, is a `RunFileError` that names
the key, the file and its line, before anything starts; so is an unknown environment (or eval
suite), a plugin that fails to import, or an option the environment does not take (envcheck.py),
and an unknown model name, or a model directory that is missing or holds an architecture the
engine does not implement (modelcheck.py).
`run_env` turns the plan into the `SLIPSTREAM_<SECTION>__<FIELD>` variables the services read;
`env_file` writes them for the dev overlay's `slipstream-env` ConfigMap and for Tilt's local mode,
so all three read one file.
"""

from __future__ import annotations

import re
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal

import msgspec

from slipstream.run.envcheck import check_env, check_suites
from slipstream.run.modelcheck import check_model
from slipstream.run.plan import TrainingPlan, check_loss, run_env


class RunFileError(ValueError):
    """A run file that cannot be used; the message names the file, the line and the key."""


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    pass


class ModelSection(_Section):
    preset: str | None = None
    name: str | None = None
    path: str | None = None
    device: str | None = None
    rollout_dtype: str | None = None
    learner_autocast: str | None = None
    lora_rank: int | None = None
    lora_alpha: float | None = None


class EnvSection(_Section):
    name: str | None = None
    options: dict[str, Any] | None = None


class AlgorithmSection(_Section):
    loss: str | None = None
    lr: float | None = None
    loss_constant: float | None = None
    max_staleness: int | None = None
    temperature: float | None = None
    kl_coef: float | None = None
    kl_estimator: str | None = None
    substeps: int | None = None
    loss_options: dict[str, Any] | None = None


class BatchSection(_Section):
    group_size: int | None = None
    groups_per_step: int | None = None
    max_steps: int | None = None
    max_tokens: int | None = None
    micro_batch: int | None = None
    task_sampler: Literal["off", "pass_rate"] | None = None


class WarmstartSection(_Section):
    sft_steps: int | None = None
    sft_batch: int | None = None
    sft_lr: float | None = None
    sft_target_accuracy: float | None = None
    sft_check_every: int | None = None
    sft_settle_steps: int | None = None
    sft_target_sampled: float | None = None
    sft_pool_tasks: int | None = None
    sft_copy_steps: int | None = None
    sft_copy_rows: int | None = None
    sft_drill_rows: int | None = None
    sft_from: str | None = None


class EvalSection(_Section):
    heldout_tasks: int | None = None
    heldout_samples: int | None = None
    eval_every: int | None = None
    train_eval_tasks: int | None = None
    suites: dict[str, int] | None = None


class SummarySection(_Section):
    enabled: bool | None = None
    mode: Literal["summary", "truncate"] | None = None
    min_tokens: int | None = None
    max_tokens: int | None = None
    summary_tokens: int | None = None
    max_summaries: int | None = None
    request: str | None = None
    stop: list[str] | None = None
    restart_template: str | None = None
    policy: bool | None = None
    open: str | None = None
    train_summaries: bool | None = None
    loss_weighting: Literal["token", "episode"] | None = None


class RolloutSection(_Section):
    max_batch: int | None = None
    tasks_in_flight: int | None = None
    max_seq_len: int | None = None
    screen_target: float | None = None
    summary: SummarySection | None = None


class LearnerSection(_Section):
    ranks: int | None = None
    reward_schedule: dict[str, dict[str, Any]] | None = None
    toggle: dict[str, Any] | None = None
    sft_export: bool | None = None
    sft_export_min_reward: float | None = None
    router_replay: bool | None = None
    moe_aux_coef: float | None = None


class EndpointSection(_Section):
    enabled: bool | None = None
    host: str | None = None
    port: int | None = None
    model_name: str | None = None
    renderer: str | None = None
    api_keys: list[str] | None = None
    default_max_tokens: int | None = None
    max_tokens_limit: int | None = None
    session_idle_s: float | None = None


class EngineSection(_Section):
    type: Literal["torch", "http", "vllm"] | None = None
    url: str | None = None
    request_timeout_s: float | None = None
    weights_timeout_s: float | None = None
    vllm_python: str | None = None
    vllm_start_timeout_s: float | None = None
    vllm_kv_cache_gb: int | None = None
    vllm_max_model_len: int | None = None
    vllm_enforce_eager: bool | None = None
    vllm_threads: int | None = None
    vllm_args: list[str] | None = None


class ReplicasSection(_Section, rename="kebab"):
    rollout_worker: int = 1
    reward_model: int = 1
    eval_gate: int = 1
    tool_service: int = 0
    subagent_pool: int = 0


class InfraSection(_Section):
    nats_url: str = ""
    redis_url: str = ""
    store: str = ""


class RunFile(_Section):
    """One experiment, as written; `plan()` resolves it into a `TrainingPlan`."""

    name: str = ""
    seed: int | None = None
    timeout_s: float | None = None
    stall_timeout_s: float | None = None
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    env: EnvSection = msgspec.field(default_factory=EnvSection)
    algorithm: AlgorithmSection = msgspec.field(default_factory=AlgorithmSection)
    batch: BatchSection = msgspec.field(default_factory=BatchSection)
    warmstart: WarmstartSection = msgspec.field(default_factory=WarmstartSection)
    eval: EvalSection = msgspec.field(default_factory=EvalSection)
    rollout: RolloutSection = msgspec.field(default_factory=RolloutSection)
    learner: LearnerSection = msgspec.field(default_factory=LearnerSection)
    endpoint: EndpointSection | None = None
    engine: EngineSection | None = None
    replicas: ReplicasSection = msgspec.field(default_factory=ReplicasSection)
    infra: InfraSection = msgspec.field(default_factory=InfraSection)

    def plan(self) -> TrainingPlan:
        """The training plan: `TrainingPlan`'s defaults, overridden by every key the file sets."""
        fields: dict[str, Any] = {}
        renames = {
            ("model", "name"): "model",
            ("model", "path"): "model",
            ("env", "name"): "env",
            ("env", "options"): "env_options",
            ("rollout", "max_batch"): "worker_max_batch",
            ("rollout", "tasks_in_flight"): "worker_tasks_in_flight",
            ("learner", "ranks"): "learner_ranks",
            ("eval", "suites"): "eval_suites",
        }
        if self.replicas.tool_service:
            fields["tool_service_replicas"] = self.replicas.tool_service
        if self.replicas.subagent_pool:
            fields["subagent_pool_replicas"] = self.replicas.subagent_pool
        for top in ("seed", "timeout_s", "stall_timeout_s"):
            if getattr(self, top) is not None:
                fields[top] = getattr(self, top)
        for section in ("model", "env", "algorithm", "batch", "warmstart", "eval", "rollout", "learner"):
            for key, value in msgspec.structs.asdict(getattr(self, section)).items():
                if value is not None and (section, key) != ("rollout", "summary"):
                    fields[renames.get((section, key), key)] = value
        if self.rollout.summary is not None:
            summary = {k: v for k, v in msgspec.structs.asdict(self.rollout.summary).items() if v is not None}
            weighting = summary.pop("loss_weighting", None)
            if weighting is not None:
                fields["sample_weighting"] = weighting
            if summary:
                summary.setdefault("enabled", True)  # a [rollout.summary] table that says nothing else means it
                fields["summary"] = summary
        if self.endpoint is not None:
            endpoint = {k: v for k, v in msgspec.structs.asdict(self.endpoint).items() if v is not None}
            endpoint.setdefault("enabled", True)  # an [endpoint] table that says nothing else means it
            fields["endpoint"] = endpoint
        if self.engine is not None:
            fields["engine"] = {k: v for k, v in msgspec.structs.asdict(self.engine).items() if v is not None}
        if self.learner.ranks is not None and self.learner.ranks < 1:
            raise ValueError(f"[learner] ranks must be >= 1, got {self.learner.ranks}")
        return msgspec.convert(fields, TrainingPlan)


def load(path: str | Path) -> RunFile:
    """Read and check a run file; every problem is a RunFileError naming file, line and key."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise RunFileError(f"{path}: cannot read the run file: {exc.strerror or exc}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RunFileError(f"{path}: not valid TOML: {exc}") from exc
    try:
        run = msgspec.convert(data, RunFile)
    except msgspec.ValidationError as exc:
        raise RunFileError(_located(path, text, str(exc))) from exc
    if run.env.name is not None and not re.fullmatch(r"[a-z][a-z0-9_]*", run.env.name):
        raise RunFileError(f"{path}:{_line_of(text, 'env', 'name')}: [env] name {run.env.name!r} is not an env name")
    # The model exists and is one the engine implements; a directory is made absolute (from the
    # run file's own directory), so every service finds it whatever its working directory.
    if run.model.name is not None and run.model.path is not None:
        raise RunFileError(
            f"{path}:{_line_of(text, 'model', 'path')}: [model] takes name or path, not both "
            f"(name = {run.model.name!r}, path = {run.model.path!r})"
        )
    try:
        if run.model.name is not None:
            check_model(run.model.name, named=True)
        if run.model.path is not None:
            run.model.path = check_model(run.model.path, base=path.parent)
    except ValueError as exc:
        key = "name" if run.model.name is not None else "path"
        raise RunFileError(f"{path}:{_line_of(text, 'model', key)}: [model] {exc}") from None
    # The task screen reads the policy's log-probs in the rollout worker's own process, which only the
    # torch engine has there; otherwise the worker would fail in setup, after starting its server.
    engine_type = run.engine.type if run.engine and run.engine.type else "torch"
    if engine_type != "torch" and (run.rollout.screen_target or 0) > 0:
        raise RunFileError(
            f"{path}:{_line_of(text, 'rollout', 'screen_target')}: [rollout] screen_target = "
            f"{run.rollout.screen_target} needs [engine] type = 'torch' (the screen reads the model's log-probs "
            f"in the worker's process); [engine] type is {engine_type!r}: set screen_target = 0"
        )
    # The environment, its options and the eval suites exist: what every service will ask.
    env = run.env.name or TrainingPlan().env
    for table, key, check in (
        ("env", "name", lambda: check_env(env)),
        ("env", "options", lambda: check_env(env, run.env.options or {})),
        ("eval", "suites", lambda: check_suites(run.eval.suites or {})),
        ("algorithm", "loss_options", lambda: check_loss_section(run.algorithm)),
        ("endpoint", "renderer", lambda: check_renderer(run.endpoint.renderer if run.endpoint else None)),
    ):
        try:
            check()
        except ValueError as exc:
            raise RunFileError(f"{path}:{_line_of(text, table, key)}: [{table}] {exc}") from None
    return run


def check_renderer(name: str | None) -> None:
    """A named [endpoint] renderer exists in libs/toolcalls ('' or None: follow the model)."""
    if name:
        from slipstream.toolcalls import renderer_for

        renderer_for(name)  # ValueError: "no renderer for model family 'x'; known: ..."


def check_loss_section(a: AlgorithmSection) -> None:
    """[algorithm]'s loss settings are a valid [loss] section (unknown loss_options keys included)."""
    plan = TrainingPlan()
    if a.substeps is not None and a.substeps < 1:
        raise ValueError(f"substeps must be >= 1, got {a.substeps}")
    check_loss(
        a.loss or plan.loss,
        plan.kl_coef if a.kl_coef is None else a.kl_coef,
        a.kl_estimator or plan.kl_estimator,
        a.loss_options or {},
    )


def env_file(run: RunFile) -> str:
    """The run's service config as an env file (KEY=VALUE lines, sorted): the dev overlay's `run.env`.

    The run id is left to each deployment (the overlay's slipstream.env, Tilt's local mode)."""
    env = run_env(run.plan())
    lines = [f"{key}={value}" for key, value in sorted(env.items())]
    return (
        "# Rendered from a run file by `slipstream train RUN.toml --env-file`; do not edit by hand.\n"
        + "\n".join(lines)
        + "\n"
    )


def parse_env_file(text: str) -> dict[str, str]:
    """KEY=VALUE lines back into a mapping (comments and blank lines skipped)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value
    return out


# -------------------------------------------------------------------------------- locating errors

_UNKNOWN = re.compile(r"Object contains unknown field `(?P<key>[^`]+)`(?: - at `\$(?P<path>[^`]*)`)?")
_AT = re.compile(r"^(?P<what>.*) - at `\$(?P<path>[^`]*)`$")


def _located(path: Path, text: str, message: str) -> str:
    unknown = _UNKNOWN.search(message)
    if unknown:
        table = (unknown.group("path") or "").lstrip(".")
        key = unknown.group("key")
        where = f"[{table}] " if table else ""
        known = _known_keys(table)
        hint = f" (known: {', '.join(known)})" if known else ""
        return f"{path}:{_line_of(text, table, key)}: unknown key {where}{key!r}{hint}"
    at = _AT.match(message)
    if at:
        parts = at.group("path").lstrip(".").split(".")
        table, key = ".".join(parts[:-1]), parts[-1]
        return f"{path}:{_line_of(text, table, key)}: {'.'.join(parts)}: {at.group('what')}"
    return f"{path}: {message}"


def _known_keys(table: str) -> list[str]:
    cls: Any = RunFile
    for part in [p for p in table.split(".") if p]:
        field = next((f for f in msgspec.structs.fields(cls) if f.encode_name == part), None)
        # An optional table (`EndpointSection | None`) is its struct type.
        kinds = [field.type, *typing.get_args(field.type)] if field is not None else []
        structs = [k for k in kinds if isinstance(k, type) and issubclass(k, msgspec.Struct)]
        if not structs:
            return []
        cls = structs[0]
    return [f.encode_name for f in msgspec.structs.fields(cls)]


def _line_of(text: str, table: str, key: str) -> int:
    """1-based line of `key` inside `[table]` ('' = top level); the table's header line, else 1."""
    current, header_line = "", 0
    key_re = re.compile(rf"""^\s*(?:{re.escape(key)}|"{re.escape(key)}"|'{re.escape(key)}')\s*=""")
    for number, line in enumerate(text.splitlines(), start=1):
        header = re.match(r"^\s*\[\s*([^\]]+?)\s*\]", line)
        if header:
            current = header.group(1).strip().strip('"')
            if current == (f"{table}.{key}" if table else key):  # the unknown key is a table of its own
                return number
            if current == table:
                header_line = number
            continue
        if current == table and key_re.match(line):
            return number
    return header_line or 1
