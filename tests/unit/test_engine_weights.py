"""In-flight weight refresh: updates land between two decode steps, tokens carry the version that
sampled them, bad updates are refused without effect, and the engine never stops generating."""

from __future__ import annotations

import asyncio

import pytest
import torch

from slipstream.engine import (
    ByteTokenizer,
    CausalLM,
    GenerationRequest,
    GenerationResult,
    ModelConfig,
    SamplingParams,
    TorchEngine,
    build_tiny,
)

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

OLD_SEED, NEW_SEED = 21, 22
TOK = ByteTokenizer()
PROMPT = TOK.encode("12+30=")
N = 24  # completion length
K = 9  # tokens sampled before the update


def _models() -> tuple[CausalLM, CausalLM]:
    old, _ = build_tiny("tiny", seed=OLD_SEED)
    new, _ = build_tiny("tiny", seed=NEW_SEED)
    return old.eval(), new.eval()


def _greedy(rid: str = "r", n: int = N) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid, prompt_ids=PROMPT, params=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    )


def _finish(engine: TorchEngine) -> dict[str, GenerationResult]:
    out: dict[str, GenerationResult] = {}
    while engine.has_work:
        out.update((r.request_id, r) for r in engine.step())
    return out


def _run_with_update_after(engine: TorchEngine, k: int, version: int, tensors: dict[str, torch.Tensor]) -> list[int]:
    engine.submit(_greedy())
    engine.step()  # prefill samples token 1 and the same step's decode samples token 2
    while len(engine._slots[0].completion) < k:  # type: ignore[union-attr]
        engine.step()
    engine.apply_weights(version, tensors)
    assert engine.policy_version == 0  # queued, not applied yet
    res = _finish(engine)["r"]
    return res.completion_ids, res  # type: ignore[return-value]


def test_update_mid_request_with_recompute_matches_new_weights() -> None:
    old, new = _models()
    engine = TorchEngine(old, TOK, device="cpu", max_seq_len=64, recompute_kv_on_update=True)
    ids, res = _run_with_update_after(engine, K, 1, dict(new.state_dict()))
    assert engine.policy_version == 1
    assert res.segments == [(0, K), (1, N - K)]
    assert sum(n for _, n in res.segments) == len(res.completion_ids) == N
    assert res.policy_versions == [0] * K + [1] * (N - K)
    # Before the update: greedy under the old weights. After: greedy under the new weights, given
    # the prefix so far (the recomputed cache makes this exact).
    # (The engine copied the new weights into `old` in place, so rebuild the old reference.)
    ref_old, _ = build_tiny("tiny", seed=OLD_SEED)
    seq = list(PROMPT)
    with torch.no_grad():
        for i, tok in enumerate(ids):
            ref = ref_old if i < K else new
            assert tok == int(ref(torch.tensor([seq]))[0, -1].argmax()), f"token {i}"
            seq.append(tok)
    stats = engine.stats()
    assert stats["weight_updates"] == 1 and stats["last_weight_apply_ms"] > 0
    # The engine's weights are now exactly the new ones.
    for name, value in new.state_dict().items():
        assert torch.equal(engine.state_dict()[name], value), name


def test_update_mid_request_keeping_the_cache() -> None:
    old, new = _models()
    no_update = _finish_one(TorchEngine(build_tiny("tiny", seed=OLD_SEED)[0], TOK, device="cpu", max_seq_len=64))
    engine = TorchEngine(old, TOK, device="cpu", max_seq_len=64)
    ids, res = _run_with_update_after(engine, K, 5, dict(new.state_dict()))
    assert res.segments == [(0, K), (5, N - K)]
    assert ids[:K] == no_update[:K]
    assert ids[K:] != no_update[K:]  # the new weights did take over
    # Reference for "kept" KV: the prefix cache is built under the old weights, later tokens
    # are decoded under the new weights on top of it.
    ref_new, _ = build_tiny("tiny", seed=NEW_SEED)
    ref_old, _ = build_tiny("tiny", seed=OLD_SEED)
    cache = ref_old.new_cache(1, 64)
    seq = list(PROMPT) + ids[:K]
    with torch.no_grad():
        ref_old.forward_cached(torch.tensor([seq[:-1]]), torch.arange(len(seq) - 1)[None], cache, [0])
        for i in range(K, N):
            logits = ref_new.forward_cached(torch.tensor([[seq[-1]]]), torch.tensor([[len(seq) - 1]]), cache, [0])
            seq.append(int(logits[0, -1].argmax()))
            assert seq[-1] == ids[i], f"token {i}"


def _finish_one(engine: TorchEngine) -> list[int]:
    engine.submit(_greedy())
    return _finish(engine)["r"].completion_ids


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda sd: sd.update({"model.norm.weight": torch.ones(5)}), r"'model.norm.weight' has shape \(5,\)"),
        (lambda sd: sd.update({"model.layers.9.mlp.up_proj.weight": torch.ones(1)}), "unknown tensor"),
        (lambda sd: sd.pop("model.layers.2.self_attn.k_proj.weight"), "missing"),
        (
            lambda sd: sd.update({"lm_head.weight": sd["lm_head.weight"].to(torch.bfloat16)}),
            "'lm_head.weight' has dtype torch.bfloat16",
        ),
    ],
)
def test_bad_update_is_refused_and_changes_nothing(mutate: object, message: str) -> None:
    old, new = _models()
    engine = TorchEngine(old, TOK, device="cpu", max_seq_len=64)
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    tensors = dict(new.state_dict())
    mutate(tensors)  # type: ignore[operator]
    with pytest.raises(ValueError, match=message):
        engine.apply_weights(3, tensors)
    assert engine.pending_version is None
    engine.submit(_greedy(n=3))
    res = _finish(engine)["r"]
    assert engine.policy_version == 0 and res.segments == [(0, 3)]
    for name, value in engine.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_partial_updates_only_when_allowed_and_tied_alias() -> None:
    old, new = _models()
    engine = TorchEngine(old, TOK, device="cpu", max_seq_len=64)
    part = {"model.norm.weight": new.state_dict()["model.norm.weight"]}
    with pytest.raises(ValueError, match="38 tensors missing"):
        engine.apply_weights(1, part)
    engine.apply_weights(1, part, partial=True)
    engine.step()
    assert engine.policy_version == 1
    assert torch.equal(engine.state_dict()["model.norm.weight"], part["model.norm.weight"])
    assert not torch.equal(engine.state_dict()["lm_head.weight"], new.state_dict()["lm_head.weight"])

    cfg = ModelConfig(**{**_fields(old.config), "tie_word_embeddings": True})
    tied, _ = build_tiny(cfg, seed=1)
    other, _ = build_tiny(cfg, seed=2)
    engine = TorchEngine(tied, TOK, device="cpu", max_seq_len=64)
    # Both spellings of the shared matrix are accepted; either alone completes the set.
    engine.apply_weights(2, dict(other.state_dict()))
    engine.step()
    assert torch.equal(engine.model.lm_head.weight, other.model.embed_tokens.weight)
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight


def _fields(cfg: ModelConfig) -> dict[str, object]:
    return {f: getattr(cfg, f) for f in cfg.__struct_fields__}


def test_queued_updates_merge_and_the_last_version_wins() -> None:
    old, new = _models()
    engine = TorchEngine(old, TOK, device="cpu", max_seq_len=64)
    engine.apply_weights(1, dict(new.state_dict()))
    engine.apply_weights(2, {"model.norm.weight": torch.full((128,), 0.5)}, partial=True)
    assert engine.pending_version == 2
    engine.step()
    assert engine.policy_version == 2 and engine.stats()["weight_updates"] == 1
    assert torch.equal(engine.state_dict()["model.norm.weight"], torch.full((128,), 0.5))
    assert torch.equal(engine.state_dict()["lm_head.weight"], new.state_dict()["lm_head.weight"])


async def test_engine_keeps_generating_through_an_update() -> None:
    old, new = _models()
    engine = TorchEngine(old, TOK, device="cpu", max_seq_len=128, max_batch=4)
    await engine.start()
    try:
        params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
        reqs = [GenerationRequest(request_id=f"g{i}", prompt_ids=PROMPT, params=params) for i in range(3)]
        tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
        # Every request admitted (so each already has old-version tokens) and some progress made.
        while engine.stats()["running"] < 3 or engine.stats()["tokens_generated"] < 15:
            await asyncio.sleep(0.001)
        engine.apply_weights(7, dict(new.state_dict()))
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
        assert [r.finish_reason for r in results] == ["length"] * 3
        for r in results:
            assert sum(n for _, n in r.segments) == len(r.completion_ids) == 40
            assert [v for v, _ in r.segments] == [0, 7], r.segments
        assert engine.policy_version == 7
        # An idle engine applies an update without waiting for traffic.
        engine.apply_weights(8, dict(old.state_dict()))
        for _ in range(2000):
            if engine.policy_version == 8:
                break
            await asyncio.sleep(0.001)
        assert engine.policy_version == 8
        assert engine.stats()["requests_aborted"] == 0
    finally:
        await engine.stop()
