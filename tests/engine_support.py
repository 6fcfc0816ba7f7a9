"""Driving a TorchEngine to completion in tests (the engine kernel tests share it)."""

from __future__ import annotations

from slipstream.engine import GenerationRequest, TorchEngine


def run_engine(engine: TorchEngine, requests: list[GenerationRequest]) -> dict[str, tuple[list[int], list[float]]]:
    """Submit every request and step until idle: request id -> (completion ids, log-probs)."""
    for r in requests:
        engine.submit(r)
    out: dict[str, tuple[list[int], list[float]]] = {}
    while engine.has_work:
        for res in engine.step():
            out[res.request_id] = (res.completion_ids, res.logprobs)
    return out
