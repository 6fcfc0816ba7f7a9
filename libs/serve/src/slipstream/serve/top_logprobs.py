"""`top_logprobs`: the k likeliest tokens at each completion position, beside the sampled one.

The engine returns only the sampled token's log-prob (what the learner needs), so the
alternatives are computed after the call, by one teacher-forced forward of the engine's own
model over prompt + completion: the distribution at each position is processed exactly as the
sampler processed it (`sampling.process_logits`: temperature, top-k, top-p; a greedy call's under
the raw logits, as its recorded log-probs are), then its top k are taken. This is a second
forward over the whole call (the price of asking) and it needs the model in this process (a
TorchEngine; an engine behind HTTP is refused by name). The full forward and the engine's cached
one agree to fp32 rounding (tests/integration/test_hf_architectures.py), so the sampled token's
own entry matches its recorded log-prob to ~1e-5, not bit for bit. The weights are those of the
engine when the alternatives are computed; a call served while a new version landed would get
another version's alternatives, so the version they come from is reported with them
(the `x-slipstream-top-logprobs-version` header).
"""

from __future__ import annotations

import asyncio
from typing import Any

from slipstream.serve.call_record import CallRecord
from slipstream.serve.protocol import RequestError

Alternatives = list[list[tuple[int, float]]]
"""Per completion token: (token id, log-prob) of the k likeliest, most likely first."""


async def top_alternatives(engine: Any, record: CallRecord, k: int) -> tuple[Alternatives, int]:
    """The top `k` of every completion position of `record`, and the policy version they come from."""
    model = getattr(engine, "model", None)
    if model is None or not hasattr(model, "hidden_states"):
        raise RequestError(
            "'top_logprobs' needs the model in the serving process (a torch engine); this engine has none",
            param="top_logprobs",
        )
    version = int(engine.policy_version)
    return await asyncio.to_thread(_compute, model, record, k), version


def _compute(model: Any, record: CallRecord, k: int) -> Alternatives:
    import torch

    from slipstream.engine.sampling import process_logits

    if not record.completion_ids:
        return []
    params = record.params
    p = len(record.prompt_ids)
    weight = model.lm_head.weight
    ids = torch.tensor([record.prompt_ids + record.completion_ids], dtype=torch.long, device=weight.device)
    with torch.no_grad():
        # Position p - 1 + i predicts completion token i; the last token predicts nothing asked for.
        hidden = model.hidden_states(ids[:, :-1])[0, p - 1 :]
        logits = model.lm_head(hidden).float()
        if params.temperature == 0.0:
            logp = logits.log_softmax(dim=-1)
        else:
            rows = logits.shape[0]
            logp = process_logits(
                logits,
                torch.full((rows,), params.temperature, device=logits.device),
                torch.full((rows,), params.top_k, dtype=torch.long, device=logits.device),
                torch.full((rows,), params.top_p, device=logits.device),
            )
        values, indices = logp.topk(min(k, logp.shape[-1]), dim=-1)
    # Tokens top-k/top-p removed (-inf) are not alternatives: fewer than k come back then.
    return [
        [(int(t), float(v)) for t, v in zip(row_ids, row_vals, strict=True) if v != float("-inf")]
        for row_ids, row_vals in zip(indices.tolist(), values.tolist(), strict=True)
    ]
