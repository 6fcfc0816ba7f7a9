"""`slipstream bench engine`: the engine and the learner against plain Hugging Face on a real model.

Generation: `TorchEngine` (through its async face, as a rollout worker drives it) against
`transformers`' `generate` on the same SmolLM2-135M weights, same prompts, same number of new
tokens per row (eos ignored), sampling at temperature 0.7, for each batch size and dtype. The
defaults are the real-model demo's rollouts (prompts of ~128 tokens, 48 new tokens). Two
workloads:

- `group` (the RL workload): B rows = B/8 prompts x 8 samples, as GRPO samples a group. HF
  gets the B rows as one batch (what `num_return_sequences=8` expands to); the engine gets B
  requests and prefills each distinct prompt once.
- `distinct`: B different prompts of the same length.
- `chat`: B different prompts of the real-model demo (its `search_call` task: the system prompt,
  the one-shot example and a question, through the model's chat template), each sampled until
  the model's eos or `--new` tokens, as an eval pass or a serving load sends them. HF gets them
  left-padded as one batch (stopping at eos, as `generate` does); the engine prefills the prompts'
  common opening once and retires each row when it ends. Tokens counted: each row's completion up
  to and including its eos, for both systems.

On an AVX2 CPU the engine runs bf16 matmuls as fp32 on the upcast bf16 values (torch's own
bf16 GEMM is ~30x slower there); HF `generate` runs torch's bf16 kernels as shipped.
`--native-bf16` makes the engine use them too. Each row records `engine_bf16_upcast`.
In fp32 on CPU the engine decodes with MKL's packed GEMM (weights packed once; HF's path is
left as shipped); `--no-mkl-pack` turns that off. Each row records `engine_mkl_pack`.

Tokens/s counts generated tokens over the wall time of the whole call (prefill included). Each
repeat runs both systems back to back, alternating which goes first, and the figure is the
median over repeats of each pair's ratio; the machine's load average is recorded with it.

vLLM (`--vllm`, opt-in; vllm_server.py): a vLLM server from the vLLM venv is a third system in
every repeat, on the same prompts through the same Engine calls (the order rotates over the
three), with `engine_vs_vllm` and `vllm_vs_hf` ratios beside `ratio`; the JSON's `vllm` section
has its start time and memory per dtype, or why it was skipped. `startup` has the seconds each
in-process model took to load and the bench process's peak RSS (the Slipstream engine and HF).

Learner: one optimizer step of the learner's `Trainer` (GRPO loss, fp32 master weights, bf16
autocast as the real-model demo trains, or fp32 on a CPU without a fast bf16 GEMM, as the learner
itself falls back) on a batch of sequences, against a plain HF forward + cross-entropy + backward
+ AdamW step on the same token ids and the same precision.
Target: engine >= 1.5x at batch 16 and 64; learner >= 1.0x.

Speculation (`--spec-*`, skipped with `--no-speculative`): the model (`--spec-model`, default
`--model` on cuda and the `tiny` preset on cpu, where distilling SmolLM2's drafts would take
hours) gets `--spec-tokens` MTP modules, self-distilled on its own samples; then the engine
decodes the same requests with and without speculative decoding
(`slipstream.engine.speculative_bench`) at each `--spec-batches` size: draft acceptance rate and
tokens/s both ways, greedy and sampled, in the same run, with the drafts' held-out KL before and
after distillation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from slipstream.bench.moe import add_moe_arguments, moe_section
from slipstream.bench.vllm_server import (
    VllmPlan,
    add_vllm_arguments,
    process_peak_rss_mb,
    server_rss_mb,
    start_vllm,
    timed_load,
    vllm_plan,
    vllm_section,
)

GROUP = 8
TARGET_ENGINE = 1.5
TARGET_LEARNER = 1.0
# Cache room for a `chat` prompt (the real-model demo's are 83-87 tokens).
CHAT_PROMPT_ROOM = 384


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "engine",
        help="engine tokens/s vs HF generate, and learner tokens/s vs HF forward+backward, on SmolLM2",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", metavar="FILE", default="", help="write the results as JSON to FILE")
    p.add_argument("--model", default="smollm2-135m", help="named model or local HF directory (default smollm2-135m)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64], help="batch sizes (default 1 16 64)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="(default float32 bfloat16)")
    p.add_argument(
        "--workloads",
        nargs="+",
        default=["group", "distinct", "chat"],
        choices=("group", "distinct", "chat"),
        help="(default all three)",
    )
    p.add_argument(
        "--prompt-len", type=int, default=128, help="prompt tokens per row (default 128, as the real-model demo's)"
    )
    p.add_argument("--new", type=int, default=48, help="tokens generated per row (default 48)")
    p.add_argument("--repeats", type=int, default=3, help="pairs per configuration; medians reported (default 3)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    p.add_argument("--learner-batch", type=int, default=8, help="sequences per learner step (default 8)")
    p.add_argument("--learner-len", type=int, default=256, help="tokens per learner sequence (default 256)")
    p.add_argument("--no-learner", action="store_true", help="skip the learner comparison")
    p.add_argument("--no-generation", action="store_true", help="skip the engine comparison")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument(
        "--native-bf16",
        action="store_true",
        help="engine uses torch's bf16 matmuls even where it would upcast them to fp32 (see engine kernels.py)",
    )
    p.add_argument(
        "--no-mkl-pack",
        action="store_true",
        help="engine uses F.linear in fp32 instead of MKL's packed GEMM (see engine kernels.py)",
    )
    add_moe_arguments(p)  # the MoE router-replay section (moe.py)
    add_vllm_arguments(p)  # vLLM as a third backend (vllm_server.py)
    p.add_argument("--no-speculative", action="store_true", help="skip the speculative decoding section")
    p.add_argument(
        "--spec-model",
        default="",
        help="model of the speculation section: a name, directory or preset (default: --model on cuda, tiny on cpu)",
    )
    p.add_argument("--spec-tokens", type=int, default=3, help="draft tokens per step, = MTP modules (default 3)")
    p.add_argument(
        "--spec-batches", type=int, nargs="+", default=[1, 16], help="requests decoded together (default 1 16)"
    )
    p.add_argument("--spec-dtype", default="float32", help="dtype of the speculation section (default float32)")
    p.add_argument(
        "--spec-temperatures", type=float, nargs="+", default=[0.0, 0.7], help="(default 0.0 greedy and 0.7)"
    )
    p.add_argument("--spec-distill-steps", type=int, default=300, help="self-distillation steps (default 300)")
    p.add_argument("--spec-distill-lr", type=float, default=3e-3, help="(default 3e-3)")
    p.add_argument(
        "--spec-distill-positions",
        type=int,
        default=1024,
        help="positions per distillation step, sampled from its batch; 0 = all (default 1024)",
    )
    p.add_argument("--spec-corpus-prompts", type=int, default=64, help="prompts the distillation corpus samples (64)")
    p.add_argument("--spec-corpus-samples", type=int, default=4, help="samples per corpus prompt (default 4)")
    p.add_argument("--spec-corpus-tokens", type=int, default=96, help="tokens per corpus sample (default 96)")
    p.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    result = run(args)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")
    return 0


def _prompts(tok: Any, *, batch: int, length: int, workload: str) -> list[list[int]]:
    """`batch` prompts of exactly `length` tokens; in `group`, each distinct one repeated GROUP times."""
    distinct = batch if workload == "distinct" else max(1, batch // GROUP)
    out: list[list[int]] = []
    for i in range(distinct):
        text = f"Task {i}: a user asks question number {i * 7919 % 1000} about the history of city {i}. " * 40
        ids = tok.encode(text)[:length]
        if len(ids) < length:
            raise ValueError(f"prompt {i} has only {len(ids)} tokens, fewer than --prompt-len {length}")
        out.append(ids)
    return [out[r % distinct] if workload == "distinct" else out[r // GROUP % distinct] for r in range(batch)]


def _chat_prompts(tok: Any, *, batch: int) -> list[list[int]]:
    """`batch` distinct prompts of the real-model demo's task, rendered by the model's chat template."""
    from slipstream.envs.registry import get_env

    env = get_env("search_call")
    tasks = env.generate("train", batch, seed=0)
    if len(tasks) < batch:
        raise ValueError(f"search_call gave {len(tasks)} distinct tasks, fewer than batch {batch}")
    template = tok.chat_template
    if template is None:
        raise ValueError("the chat workload needs a model with a chat template")
    return [tok.encode(template.render(env.chat_messages(t, t.prompt), add_generation_prompt=True)) for t in tasks]


async def _engine_call(engine: Any, prompts: list[list[int]], new: int, tag: str, *, stop_at_eos: bool = False) -> int:
    from slipstream.engine.interface import GenerationRequest, SamplingParams

    params = SamplingParams(temperature=0.7, max_tokens=new, ignore_eos=not stop_at_eos)
    results = await asyncio.gather(
        *(
            engine.generate(GenerationRequest(request_id=f"{tag}/{i}", prompt_ids=p, params=params))
            for i, p in enumerate(prompts)
        )
    )
    return sum(len(r.completion_ids) for r in results)


def _hf_call(hf: Any, prompts: list[list[int]], new: int, device: str, *, eos: int | None = None) -> int:
    """`generate` on the prompts as one left-padded batch: `new` tokens a row with eos ignored, or,
    given `eos`, stopping there; returns the tokens the rows made (up to and including eos)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(p)
        mask[r, width - len(p) :] = 1
    stop = {"min_new_tokens": new, "pad_token_id": 0} if eos is None else {"eos_token_id": eos, "pad_token_id": eos}
    with torch.no_grad():
        out = hf.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            do_sample=True,
            temperature=0.7,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new,
            **stop,
        )
    made = out[:, width:].tolist()
    if eos is None:
        return sum(len(row) for row in made)
    return sum(row.index(eos) + 1 if eos in row else len(row) for row in made)


async def _call(
    system: str, backend: Any, prompts: list[list[int]], new: int, tag: str, device: str, eos: int | None
) -> int:
    """One call of a system: `hf` is `generate` on the HF model; `engine` and `vllm` are Engines (the
    Slipstream engine, VllmEngine). With `eos` the rows stop there, otherwise each makes `new` tokens."""
    if system == "hf":
        return _hf_call(backend, prompts, new, device, eos=eos)
    return await _engine_call(backend, prompts, new, tag, stop_at_eos=eos is not None)


def _load_avg() -> float:
    return os.getloadavg()[0]


async def _generation(
    args: argparse.Namespace, model_dir: Path, plan: VllmPlan, servers: list[dict], startup: list[dict]
) -> list[dict[str, Any]]:
    """The engine rows; vLLM's server figures go to `servers`, load times and memory to `startup`."""
    rows: list[dict[str, Any]] = []
    max_len = max(args.prompt_len, CHAT_PROMPT_ROOM) + args.new + 8
    for dtype_name in args.dtypes:
        vllm = None
        if plan.runs:  # started first, alone: its start time is its own
            vllm, figures = await start_vllm(plan, model_dir, dtype_name, max_len)
            servers.append(figures)
        try:
            rows += await _dtype_rows(args, model_dir, dtype_name, vllm, startup)
        finally:
            if vllm is not None:
                figures["rss_mb_end"] = server_rss_mb(vllm)
                await vllm.stop()
    return rows


async def _dtype_rows(
    args: argparse.Namespace, model_dir: Path, dtype_name: str, vllm: Any, startup: list[dict]
) -> list[dict[str, Any]]:
    """One dtype's rows: each batch and workload, the systems back to back in every repeat."""
    import torch
    from transformers import AutoModelForCausalLM

    from slipstream.engine.loading import load_pretrained

    dtype = getattr(torch, dtype_name)
    (model, tok), engine_load_s = timed_load(load_pretrained, model_dir, dtype=dtype, device=args.device)
    hf, hf_load_s = timed_load(lambda: AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device))
    hf.eval()
    systems = ("engine", "hf", "vllm") if vllm is not None else ("engine", "hf")
    rows: list[dict[str, Any]] = []
    for batch in args.batches:
        rows += await _batch_rows(args, model, tok, hf, vllm, systems, dtype_name, batch)
    startup.append(
        {
            "dtype": dtype_name,
            "engine_load_s": engine_load_s,
            "hf_load_s": hf_load_s,
            "bench_process_peak_rss_mb": process_peak_rss_mb(),
        }
    )
    return rows


async def _batch_rows(
    args: argparse.Namespace,
    model: Any,
    tok: Any,
    hf: Any,
    vllm: Any,
    systems: tuple[str, ...],
    dtype_name: str,
    batch: int,
) -> list[dict[str, Any]]:
    import torch

    from slipstream.engine.engine import TorchEngine

    rows: list[dict[str, Any]] = []
    engine = TorchEngine(
        model,
        tok,
        max_batch=batch,
        max_seq_len=max(args.prompt_len, CHAT_PROMPT_ROOM) + args.new + 8,
        device=args.device,
        dtype=getattr(torch, dtype_name),
        bf16_upcast=False if args.native_bf16 else None,
        mkl_pack=False if args.no_mkl_pack else None,
    )
    await engine.start()
    backends = {"engine": engine, "hf": hf, "vllm": vllm}
    try:
        for workload in args.workloads:
            if workload == "group" and batch < GROUP:
                continue  # a group needs GROUP rows; batch 1 runs as `distinct`
            chat = workload == "chat"
            if chat:
                prompts = _chat_prompts(tok, batch=batch)
            else:
                prompts = _prompts(tok, batch=batch, length=args.prompt_len, workload=workload)
            eos = tok.eos_id if chat else None
            # Warm-up: first calls pay one-off allocation and kernel selection costs.
            for system in systems:
                await _call(system, backends[system], prompts[:2], 4, f"warm/{workload}/{system}", args.device, eos)
            pairs: list[dict[str, float]] = []
            before = engine.stats()
            for rep in range(args.repeats):
                timing: dict[str, float] = {"load_avg": _load_avg()}
                first = rep % len(systems)  # the order rotates: each system goes first in turn
                for system in systems[first:] + systems[:first]:
                    t0 = time.perf_counter()
                    tag = f"{workload}/{rep}/{system}"
                    made = await _call(system, backends[system], prompts, args.new, tag, args.device, eos)
                    timing[f"{system}_tokens"] = made
                    timing[f"{system}_tok_s"] = made / (time.perf_counter() - t0)
                timing["ratio"] = timing["engine_tok_s"] / timing["hf_tok_s"]
                if vllm is not None:
                    timing["engine_vs_vllm"] = timing["engine_tok_s"] / timing["vllm_tok_s"]
                    timing["vllm_vs_hf"] = timing["vllm_tok_s"] / timing["hf_tok_s"]
                pairs.append(timing)
            row: dict[str, Any] = {
                "dtype": dtype_name,
                "batch": batch,
                "workload": workload,
                "engine_bf16_upcast": engine.bf16_upcast,
                "engine_mkl_pack": engine.mkl_pack,
                "engine_tok_s": statistics.median(p["engine_tok_s"] for p in pairs),
                "hf_tok_s": statistics.median(p["hf_tok_s"] for p in pairs),
                "ratio": statistics.median(p["ratio"] for p in pairs),
                "load_avg": statistics.median(p["load_avg"] for p in pairs),
                "repeats": pairs,
            }
            line = ""
            if vllm is not None:
                for key in ("vllm_tok_s", "engine_vs_vllm", "vllm_vs_hf"):
                    row[key] = statistics.median(p[key] for p in pairs)
                line = f", vLLM {row['vllm_tok_s']:7.1f} tok/s (engine / vLLM {row['engine_vs_vllm']:.2f}x)"
            # What the engine's prefill computed and what it copied (a group's prompt, a
            # chat prompt's common opening), over the repeats.
            after = engine.stats()
            for key in ("prefill_tokens", "prompt_shared_tokens"):
                row[f"engine_{key}"] = int(after[key] - before[key])
            rows.append(row)
            print(
                f"{dtype_name:8} batch {batch:3} {workload:8}: engine {row['engine_tok_s']:7.1f} tok/s, "
                f"HF generate {row['hf_tok_s']:7.1f} tok/s, ratio {row['ratio']:.2f}x{line} "
                f"(load {row['load_avg']:.1f})",
                flush=True,
            )
    finally:
        await engine.stop()
    return rows


def _speculation(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from slipstream.bench.mtp_distill import load, prompts_for
    from slipstream.engine.speculative_bench import measure_speculation

    dtype = getattr(torch, args.spec_dtype)
    # On a CPU, distilling a 49k-vocabulary model's drafts costs ~10 s a step (SmolLM2, 256 positions,
    # a shared 2-core machine: measured), so the section defaults to the tiny preset there.
    name = args.spec_model or (args.model if torch.device(args.device).type == "cuda" else "tiny")
    model, tok = load(name, args.spec_dtype, args.device)
    prompts = prompts_for(tok, max(args.spec_batches), seed=0)
    corpus_prompts = prompts_for(tok, args.spec_corpus_prompts, seed=1)
    out = measure_speculation(
        model,
        tok,
        prompts,
        corpus_prompts,
        k=args.spec_tokens,
        batches=args.spec_batches,
        new_tokens=args.new,
        temperatures=args.spec_temperatures,
        distill_steps=args.spec_distill_steps,
        distill_lr=args.spec_distill_lr,
        distill_positions=args.spec_distill_positions,
        corpus_samples=args.spec_corpus_samples,
        corpus_tokens=args.spec_corpus_tokens,
        repeats=args.repeats,
        device=args.device,
        dtype=dtype,
    )
    out["model"] = name
    d = out["distill"]
    print(
        f"speculation {name} {args.spec_dtype} k={out['k']}: MTP self-distilled {d['steps']} steps on "
        f"{d['corpus_sequences']} own samples in {d['distill_s']:.0f} s, held-out KL per depth "
        f"{[round(x, 3) for x in d['held_out_kl_before']]} -> {[round(x, 3) for x in d['held_out_kl_after']]}",
        flush=True,
    )
    for row in out["rows"]:
        print(
            f"speculation T={row['temperature']:.1f} batch {row['batch']}: acceptance {row['acceptance_rate']:.3f}, "
            f"{row['tokens_per_row_step_speculative']:.2f} tokens a row per step; plain {row['plain_tok_s']:.1f} "
            f"tok/s, speculative {row['speculative_tok_s']:.1f} tok/s, speed-up {row['speedup']:.2f}x "
            f"(load {row['load_avg']:.1f})",
            flush=True,
        )
    return out


def _learner_figures(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from slipstream.engine.loading import load_pretrained
    from slipstream.learner.config import LearnerSection
    from slipstream.learner.trainer import Trainer
    from slipstream.rl import LossConfig
    from slipstream.schemas import PolicySegment, ScoredTrajectory, Trajectory, scored_episode_from_v1
    from slipstream.schemas.packing import pack_floats, pack_ids, pack_mask

    n, length = args.learner_batch, args.learner_len
    prompt = length // 2
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 10000, (n, length), generator=gen)
    group = [
        scored_episode_from_v1(
            ScoredTrajectory(
                trajectory=Trajectory(
                    trajectory_id=f"t{i}",
                    task_id="bench",
                    env="bench",
                    group_index=i,
                    group_size=n,
                    prompt_len=prompt,
                    token_ids=pack_ids(ids[i].tolist()),
                    logprobs=pack_floats([-2.0] * (length - prompt)),
                    loss_mask=pack_mask([1] * (length - prompt)),
                    segments=[PolicySegment(policy_version=0, n_tokens=length - prompt)],
                ),
                reward=float(i % 2),
                correct=bool(i % 2),
            )
        )
        for i in range(n)
    ]
    tokens = n * length
    section = LearnerSection(lr=1e-5, micro_batch=n, autocast="bfloat16")
    model, _ = load_pretrained(model_dir, dtype=torch.float32, device=args.device)
    trainer = Trainer(model, section, LossConfig(), pad_id=0)
    # Both sides run what the learner runs on this device: bf16 autocast, or fp32 where the CPU has
    # no fast bf16 GEMM (AVX2 only; `effective_autocast`), so the comparison stays like for like.
    bf16 = trainer.autocast == "bfloat16"
    precision = "bf16 autocast" if bf16 else "fp32 (no fast bf16 GEMM on this CPU)"
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(args.device)
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-5)
    batch = ids.to(args.device)

    def hf_step() -> None:
        hf.train()
        with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=bf16):
            logits = hf(input_ids=batch, attention_mask=torch.ones_like(batch)).logits[:, :-1]
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        hf_opt.step()
        hf_opt.zero_grad(set_to_none=True)

    trainer.step([group], 0)  # warm-up
    hf_step()
    pairs: list[dict[str, float]] = []
    for rep in range(args.repeats):
        timing: dict[str, float] = {"load_avg": _load_avg()}
        for system in ("learner", "hf") if rep % 2 == 0 else ("hf", "learner"):
            t0 = time.perf_counter()
            if system == "learner":
                trainer.step([group], 0)
            else:
                hf_step()
            timing[f"{system}_tok_s"] = tokens / (time.perf_counter() - t0)
        timing["ratio"] = timing["learner_tok_s"] / timing["hf_tok_s"]
        pairs.append(timing)
    out = {
        "sequences": n,
        "tokens_per_sequence": length,
        "autocast": trainer.autocast or "none",
        "learner_tok_s": statistics.median(p["learner_tok_s"] for p in pairs),
        "hf_tok_s": statistics.median(p["hf_tok_s"] for p in pairs),
        "ratio": statistics.median(p["ratio"] for p in pairs),
        "repeats": pairs,
    }
    print(
        f"learner step {n}x{length} (fp32 master, {precision}): learner {out['learner_tok_s']:.0f} tok/s, "
        f"HF forward+backward {out['hf_tok_s']:.0f} tok/s, ratio {out['ratio']:.2f}x",
        flush=True,
    )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from slipstream.engine.catalog import ensure_model

    try:
        import transformers  # noqa: F401
    except ModuleNotFoundError:
        raise SystemExit("slipstream bench engine needs `transformers` (a dev dependency: make install)") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    from slipstream.engine.presets import PRESETS

    local = Path(args.model)
    model_dir = local if local.is_dir() or args.model in PRESETS else ensure_model(args.model)
    plan = vllm_plan(args)
    if args.vllm and not plan.runs:
        print(f"vLLM skipped: {plan.skipped}", flush=True)
    servers: list[dict] = []
    startup: list[dict] = []
    t0 = time.monotonic()
    load_start = _load_avg()
    generation = [] if args.no_generation else asyncio.run(_generation(args, model_dir, plan, servers, startup))
    learner = None if args.no_learner else _learner_figures(args, model_dir)
    speculation = None if args.no_speculative else _speculation(args)
    judged = [r for r in generation if r["batch"] >= 16]
    engine_met = bool(judged) and all(r["ratio"] >= TARGET_ENGINE for r in judged)
    by_workload = {
        w: all(r["ratio"] >= TARGET_ENGINE for r in judged if r["workload"] == w)
        for w in dict.fromkeys(r["workload"] for r in judged)
    }
    result: dict[str, Any] = {
        "bench": "engine",
        "model": args.model,
        "device": args.device,
        "torch_threads": torch.get_num_threads(),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new,
        "generation": generation,
        "learner": learner,
        "speculation": speculation,
        "target": {
            "engine_ratio_at_batch_16_and_64": TARGET_ENGINE,
            "engine_met": engine_met,
            "engine_met_by_workload": by_workload,
            "learner_ratio": TARGET_LEARNER,
            "learner_met": None if learner is None else learner["ratio"] >= TARGET_LEARNER,
        },
        "moe_replay": moe_section(args),
        "seconds": round(time.monotonic() - t0, 1),
        "startup": startup,
        "vllm": vllm_section(plan, servers),
        "load_avg_start_end": [load_start, _load_avg()],
    }
    if by_workload:
        verdicts = ", ".join(f"{w} {'met' if ok else 'NOT met'}" for w, ok in by_workload.items())
        print(f"engine target >= {TARGET_ENGINE}x at batch >= 16: {verdicts}")
    elif generation:
        print(f"engine target >= {TARGET_ENGINE}x: judged at batch >= 16 only, none measured")
    if learner is not None:
        print(f"learner target >= {TARGET_LEARNER}x: {'met' if result['target']['learner_met'] else 'NOT met'}")
    return result
