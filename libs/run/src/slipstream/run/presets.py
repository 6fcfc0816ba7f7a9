"""The demo's plans: `examples/<env>.toml` loaded as `TrainingPlan`s, the one place each is defined.

`slipstream demo --env ENV`, the benches, the chaos suite and the e2e tests start from
`demo_plan(env)`: for an environment with a demo plan (PRESETS) it is the run file
`examples/<env>.toml` (what `slipstream train examples/<env>.toml` trains; each file says why its
values are what they are), for any other environment `TrainingPlan`'s defaults on that env.
`pretrained_plan(model)` is the real-model demo; `with_context` and `with_length_penalty` are the
demo's flags over a plan. The examples are found beside the source (the repository root's
`examples/`), or where SLIPSTREAM_EXAMPLES points.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from slipstream.run.plan import TrainingPlan

PRESETS = ("reverse", "reasoning_gym", "lookup", "search", "recall", "code", "swarm")
"""The environments whose demo plan is `examples/<env>.toml`."""
EXAMPLES_ENV = "SLIPSTREAM_EXAMPLES"


def examples_dir() -> Path:
    """Where the run files are: $SLIPSTREAM_EXAMPLES, else the repository's `examples/`."""
    given = os.environ.get(EXAMPLES_ENV)
    return Path(given) if given else Path(__file__).resolve().parents[5] / "examples"


def demo_plan(env: str | None = None) -> TrainingPlan:
    """The demo for `env` (default: reverse): examples/<env>.toml for PRESETS, else the defaults on `env`."""
    from slipstream.run.runfile import load

    name = env or "reverse"
    if name in PRESETS:
        path = examples_dir() / f"{name}.toml"
        if not path.exists():
            raise FileNotFoundError(f"the {name} demo's plan {path} is missing (set {EXAMPLES_ENV} to examples/)")
        return load(path).plan()
    plan = TrainingPlan(eval_every=15)
    plan.env = name
    return plan


CONTEXTS = ("summary", "truncate", "full", "policy", "masked")
"""How a plan's long contexts may be handled (`with_context`)."""


def with_context(plan: Any, context: str | None) -> Any:
    """`plan` with its long contexts handled as `context` says (None: as planned).

    Every mode keeps the plan's threshold range and budget (the env's, else the harness defaults):
    "summary": past the threshold the harness asks for a summary; "truncate": the context restarts
    from its last tokens, no summary; "policy": the policy may summarise itself at any turn and a
    context that reaches the threshold unsummarised is truncated; "masked": "policy" with the
    summary tokens masked from the loss (the control for what RL teaches through them); "full":
    restarts off."""
    if context is None:
        return plan
    if context not in CONTEXTS:
        raise ValueError(f"context must be one of {', '.join(CONTEXTS)}, got {context!r}")
    if context == "full":
        plan.summary = {}
        return plan
    policy = context in ("policy", "masked")
    plan.summary = {
        **(plan.summary or {"enabled": True}),
        "enabled": True,
        "mode": "truncate" if policy else context,
        "policy": policy,
        "train_summaries": context != "masked",
    }
    return plan


def pretrained_plan(model: str) -> Any:
    """The real-model demo: LoRA on a named model, bf16 rollouts, fp32 master weights with bf16 autocast.

    Sized for 2 CPU cores (about a minute per step: 64 rollouts of <= 48 tokens, then the
    learner's pass over them); `device="auto"` moves every model to a GPU when there is one.
    """
    return TrainingPlan(
        model=model,
        env="search_call",
        sft_steps=0,
        group_size=8,
        groups_per_step=8,
        max_staleness=2,
        max_steps=10,
        lr=1e-3,
        loss_constant=1024.0,
        temperature=0.7,
        max_tokens=48,
        worker_max_batch=64,
        worker_tasks_in_flight=8,
        heldout_tasks=32,
        heldout_samples=4,
        lora_rank=16,
        lora_alpha=32.0,
        rollout_dtype="bfloat16",
        learner_autocast="bfloat16",
        micro_batch=8,
        device="auto",
        max_seq_len=512,  # prompts are ~130 tokens: a 2048-long KV cache for 64 rows would be 3 GB in bf16
        timeout_s=3600.0,
    )


def with_length_penalty(plan: Any, scale: float | None) -> Any:
    """`plan` with its env's `length_penalty.scale` set to `scale` (None: unchanged; 0: off). An env
    without the option is refused by the plan check before anything starts."""
    if scale is not None:
        if scale < 0:
            raise SystemExit(f"slipstream: --length-penalty must be >= 0, got {scale}")
        penalty = {**dict(plan.env_options.get("length_penalty") or {}), "scale": scale}
        plan.env_options = {**plan.env_options, "length_penalty": penalty}
    return plan
