"""A Qwen3-architecture model from a local directory trains end to end through `[model] path`.

The tiny demo's sizes, but built as a Qwen3 config (per-head q/k RMSNorm, an explicit head_dim that
is not hidden/heads, tied embeddings), warm-started briefly on `reverse` (SFT_STEPS supervised
steps at the demo's batch, learning rate and seed, so groups' rewards differ and the learner has
steps to take) and saved as an ordinary Hugging Face directory. A run file names that directory
with a relative `[model] path`; the plan it loads to runs on the whole stack as separate processes
(the worker's cached engine forward, the learner's full forward, the publisher's versions, the
held-out evals). Asserted: the run finished its steps, every step published a version, trajectories
were trained, and the last version is a Qwen3 state whose q/k norms moved (so the learner trained
them and the worker loaded and applied them).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slipstream.engine import build_tiny, load_pretrained, save_pretrained
from slipstream.engine.config import ModelConfig
from slipstream.engine.tokenizer import ByteTokenizer
from slipstream.envs import get_env
from slipstream.run import RunFileError, load
from slipstream.run.training import run_training
from slipstream.store import LocalObjectStore
from slipstream.supervised.warmstart import sft_warmstart
from slipstream.weights.chain import load_version

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 2
# A fixed 20-step warm-start, not the demo's "until 20% greedy" target: that took 236 steps, 118
# probe checks and ~30 s of the test's ~43 s on a quiet machine. Nothing here measures learning:
# the run only needs groups whose rewards differ so the learner takes its STEPS steps and moves
# the q/k norms (asserted below). After 20 steps the answers are well-formed only sometimes, so the
# 0.1 format reward splits most groups (measured: 64 trained, 56 dropped uniform); at 60-100 steps
# nearly every answer is well-formed and wrong, and 92-97% of the groups were uniform.
SFT_STEPS = 20
BYTES = ByteTokenizer()
QWEN3_TINY = ModelConfig(
    model_type="qwen3",
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=48,
    vocab_size=BYTES.vocab_size,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    qk_norm=True,
    bos_token_id=BYTES.BOS,
    eos_token_id=BYTES.EOS,
    pad_token_id=BYTES.PAD,
)


def _warm_started(directory: Path) -> Path:
    """The Qwen3 model, warm-started on reverse (SFT_STEPS steps, the demo's batch, lr and seed), saved."""
    from slipstream.run.presets import demo_plan

    demo = demo_plan()
    model, tokenizer = build_tiny(QWEN3_TINY, seed=0)
    sft_warmstart(
        model,
        tokenizer,
        get_env(demo.env),
        steps=SFT_STEPS,
        batch_size=demo.sft_batch,
        lr=demo.sft_lr,
        seed=demo.seed,
        temperature=demo.temperature,
    )
    return save_pretrained(model, tokenizer, directory)


@pytest.mark.timeout(900)
def test_a_qwen3_model_directory_trains_from_a_run_file(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    run_file = tmp_path / "qwen3.toml"
    run_file.write_text(
        'name = "qwen3"\nseed = 0\n\n[model]\npath = "models/qwen3-tiny"\n\n[env]\nname = "reverse"\n\n'
        f"[batch]\nmax_steps = {STEPS}\ngroups_per_step = 4\ngroup_size = 8\n\n[eval]\nheldout_tasks = 8\n"
    )
    with pytest.raises(RunFileError, match="unknown model 'models/qwen3-tiny'"):
        load(run_file)  # refused while the directory does not exist
    model_dir = _warm_started(tmp_path / "models" / "qwen3-tiny")

    plan = load(run_file).plan()
    assert plan.model == str(model_dir.resolve())
    run_dir = tmp_path / "run"
    summary = run_training(plan, run_dir)
    assert summary.ok, summary.error
    assert summary.warmstart["model"] == plan.model  # loaded as is: no warm-start of the tiny preset
    assert summary.steps == STEPS
    assert summary.versions_published == STEPS + 1
    assert summary.trajectories["trained"] > 0, summary.trajectories

    start, _ = load_pretrained(model_dir, dtype=torch.float32)
    assert start.config.model_type == "qwen3" and start.config.qk_norm
    last = load_version(LocalObjectStore(run_dir / "data" / "store"), run_dir.name, STEPS)
    moved = [
        name
        for name, value in start.state_dict().items()
        if ("q_norm" in name or "k_norm" in name) and not torch.equal(value, last[name].float())
    ]
    assert moved, "no q/k norm weight changed in the last version"
