"""How far a learner's recomputed log-probs drift from the sampler's, with and without router replay.

`measure_replay_mismatch` samples completions from a mixture-of-experts model with the engine in
one precision (bf16 by default: what rollouts run in), then recomputes every sampled token's
log-prob the way the learner does (one padded full forward, fp32 weights holding the very same
values), once routing on its own and once replaying the routes the engine recorded. The figures
say how much of the train–inference mismatch is routing: where the two forwards land on opposite
sides of a near-tie between experts, the learner computes another function than the one that
sampled, and replay removes exactly that part; what is left is the precision's own rounding.

Run with `engine_dtype=torch.float32` it is the control: the forwards differ only in batch shape
and kernel, routes almost never flip, and replay should change next to nothing.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from slipstream.engine.engine import TorchEngine
from slipstream.engine.interface import GenerationRequest, GenerationResult, SamplingParams
from slipstream.engine.model import CausalLM
from slipstream.engine.moe import force_routes, last_routes, moe_blocks, unpack_routes
from slipstream.engine.presets import build_tiny


def measure_replay_mismatch(
    model: CausalLM | None = None,
    *,
    preset: str = "tiny-moe",
    seed: int = 0,
    requests: int = 16,
    prompt_len: int = 12,
    max_tokens: int = 48,
    engine_dtype: torch.dtype = torch.bfloat16,
    temperature: float = 1.0,
    device: str = "cpu",
) -> dict[str, Any]:
    """Mismatch figures for `model` (None: the seeded `preset`), engine in `engine_dtype`, learner in fp32,
    both on `device`.

    Returns per-token figures over every sampled token whose context the engine routed:
    `mean_abs_logprob_diff` / `max_abs_logprob_diff` / `mismatch_kl` (the learner's k3 estimate
    of KL(behaviour ‖ learner), as `[learner]` reports it) for `no_replay` and `replay`, and
    `route_flip_share`: the share of (token, layer) pairs whose expert set the learner's own
    routing chose differently from the engine's.
    """
    if model is None:
        model, _ = build_tiny(preset, seed=seed)
    if not moe_blocks(model):
        raise ValueError("measure_replay_mismatch needs a mixture-of-experts model (ModelConfig.num_experts > 0)")
    from slipstream.engine.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    # The same weight values on both sides: the engine's copy in its dtype, the learner's widened to fp32.
    served = copy.deepcopy(model).to(dtype=engine_dtype)
    learner = copy.deepcopy(served).to(device=device, dtype=torch.float32).eval()
    results = _sample(served, tokenizer, engine_dtype, device, seed, requests, prompt_len, max_tokens, temperature)
    rows = [list(r.prompt_ids) + list(r.completion_ids) for r in results]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_id, dtype=torch.int64)
    attention = torch.zeros((len(rows), width), dtype=torch.bool)
    per_token = results[0].routes_per_token
    routes = torch.full((len(rows), width, per_token), -1, dtype=torch.int64)
    for i, (row, res) in enumerate(zip(rows, results, strict=True)):
        ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = True
        recorded = unpack_routes(res.routes, per_token)
        routes[i, : recorded.shape[0]] = recorded
    ids, attention, routes = ids.to(device), attention.to(device), routes.to(device)
    with torch.no_grad():
        own_logits = learner(ids, attention).cpu()
        own_routes = last_routes(moe_blocks(learner)).cpu()
        with force_routes(learner, routes):
            replay_logits = learner(ids, attention).cpu()
    ids, routes = ids.cpu(), routes.cpu()
    behaviour: list[float] = []
    own: list[float] = []
    replayed: list[float] = []
    for i, res in enumerate(results):
        p = len(res.prompt_ids)
        n = len(res.completion_ids)
        targets = ids[i, p : p + n]
        for logits, out in ((own_logits, own), (replay_logits, replayed)):
            lp = (logits[i, p - 1 : p + n - 1].float() / temperature).log_softmax(dim=-1)
            out.extend(lp.gather(1, targets[:, None])[:, 0].tolist())
        behaviour.extend(res.logprobs)
    covered = routes[..., 0] >= 0
    k = moe_blocks(learner)[0].top_k
    layers = per_token // k
    rec = routes[covered].view(-1, layers, k).sort(dim=-1).values
    mine = own_routes[covered].view(-1, layers, k).sort(dim=-1).values
    flips = (rec != mine).any(dim=-1)
    return {
        "device": device,
        "engine_dtype": str(engine_dtype).removeprefix("torch."),
        "learner_dtype": "float32",
        "requests": len(results),
        "tokens": len(behaviour),
        "route_flip_share": float(flips.float().mean()) if flips.numel() else 0.0,
        "no_replay": _figures(behaviour, own),
        "replay": _figures(behaviour, replayed),
    }


def _sample(
    model: CausalLM,
    tokenizer: Any,
    dtype: torch.dtype,
    device: str,
    seed: int,
    requests: int,
    prompt_len: int,
    max_tokens: int,
    temperature: float,
) -> list[GenerationResult]:
    engine = TorchEngine(model, tokenizer, max_batch=requests, device=device, dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    for r in range(requests):
        body = torch.randint(32, 127, (prompt_len,), generator=gen).tolist()
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=seed * 1000 + r)
        engine.submit(GenerationRequest(request_id=f"r{r}", prompt_ids=[tokenizer.bos_id, *body], params=params))
    done: dict[str, GenerationResult] = {}
    while engine.has_work:
        done.update((res.request_id, res) for res in engine.step())
    return [done[f"r{r}"] for r in range(requests)]


def _figures(behaviour: list[float], learner: list[float]) -> dict[str, float]:
    b = torch.tensor(behaviour, dtype=torch.float64)
    cur = torch.tensor(learner, dtype=torch.float64)
    log_ratio = cur - b
    return {
        "mean_abs_logprob_diff": float(log_ratio.abs().mean()),
        "max_abs_logprob_diff": float(log_ratio.abs().max()),
        # k3, as the learner's behaviour_kl: E[exp(r) - 1 - r] with r = log(learner / behaviour).
        "mismatch_kl": float((torch.expm1(log_ratio) - log_ratio).mean()),
    }
