"""Speculative decoding with MTP drafts (engine/speculative.py): greedy tokens equal plain decoding,
sampled tokens follow the main model's distribution (chi-square against exact enumeration, with a
check that the same test rejects the drafts' own distribution), recorded log-probs are the main
model's, and a weight update mid-generation lands between two speculative steps."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch

from slipstream.engine import (
    ByteTokenizer,
    CausalLM,
    GenerationRequest,
    ModelConfig,
    SamplingParams,
    TorchEngine,
    build_tiny,
)
from slipstream.engine.mtp import modules_of
from slipstream.engine.mtp_distill import attach_mtp, generate_corpus, self_distill
from slipstream.engine.sampling import row_logprobs

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

# Every test runs on the CPU, and on CUDA too where torch sees a device (marked gpu): the same
# exactness on the device the rollouts run on.
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
    ),
]


def _on(model: CausalLM, device: str) -> CausalLM:
    """`model` for an engine on `device`: a copy off the CPU (an engine moves the model it is given)."""
    return model if device == "cpu" else copy.deepcopy(model)


TOK = ByteTokenizer()
PROMPTS = [TOK.encode(p) for p in ("12+30=", "7+8=", "hello there, ", "99+1=")]


@pytest.fixture(scope="module")
def drafted() -> CausalLM:
    """The micro preset with 3 MTP modules, self-distilled briefly on its own samples, so that
    drafts are sometimes accepted and sometimes not."""
    model, tok = build_tiny("micro", seed=3)
    attach_mtp(model, 3, seed=4)
    corpus = generate_corpus(model, tok, PROMPTS, samples_per_prompt=4, max_tokens=40, temperature=0.0, seed=5)
    corpus += generate_corpus(model, tok, PROMPTS, samples_per_prompt=4, max_tokens=40, temperature=1.0, seed=6)
    self_distill(model, corpus, steps=60, lr=1e-2, batch_size=8)
    return model.eval()


def _run(engine: TorchEngine, requests: list[GenerationRequest]) -> dict[str, tuple[list[int], list[float], list]]:
    for r in requests:
        engine.submit(r)
    out = {}
    while engine.has_work:
        for res in engine.step():
            out[res.request_id] = (res.completion_ids, res.logprobs, res.segments)
    return out


def _teacher_logprobs(model: CausalLM, prompt: list[int], completion: list[int], params: SamplingParams) -> list[float]:
    """The main model's log-probs of `completion` after `prompt` from one full forward (no cache)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1 : -1]
    lp = row_logprobs(logits, [params] * len(completion))
    return lp.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_seq_len", [96, 24])
def test_greedy_tokens_equal_plain_decoding(drafted: CausalLM, max_seq_len: int, device: str) -> None:
    # max_seq_len 24 puts rows near the end of their cache, where verify rows are padded past it.
    requests = [
        GenerationRequest(
            request_id=f"r{i}",
            prompt_ids=p,
            params=SamplingParams(temperature=0.0, max_tokens=40 - 7 * i, ignore_eos=True),
        )
        for i, p in enumerate(PROMPTS)
    ]
    model = _on(drafted, device)
    plain = _run(TorchEngine(model, TOK, max_batch=4, max_seq_len=max_seq_len, device=device), requests)
    spec_engine = TorchEngine(model, TOK, max_batch=4, max_seq_len=max_seq_len, device=device, speculative_tokens=3)
    spec = _run(spec_engine, requests)
    stats = spec_engine.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"], stats
    # fewer steps than tokens: drafts were used
    assert stats["steps"] < stats["tokens_generated"]
    for rid, (ids, lps, segs) in plain.items():
        assert spec[rid][0] == ids, rid
        assert spec[rid][1] == pytest.approx(lps, abs=1e-4), rid
        assert spec[rid][2] == segs == [(0, len(ids))]


def test_sessions_resume_from_a_speculative_cache(drafted: CausalLM) -> None:
    """A session's second turn reuses the slot a speculative first turn left parked: its cached
    tokens are the ones the cache really holds, so the turn decodes as a fresh engine does."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = []
    for k in (0, 2):
        engine = TorchEngine(drafted, TOK, max_batch=2, max_seq_len=128, device="cpu", speculative_tokens=k)
        first = _run(engine, [GenerationRequest(request_id="t1", prompt_ids=PROMPTS[0], params=params, session_id="s")])
        turn2 = PROMPTS[0] + first["t1"][0] + TOK.encode(" and ")
        second = _run(engine, [GenerationRequest(request_id="t2", prompt_ids=turn2, params=params, session_id="s")])
        assert engine.stats()["kv_session_hits"] == 1
        outs.append((first["t1"][0], second["t2"][0], second["t2"][1]))
    assert outs[0][0] == outs[1][0]
    assert outs[0][1] == outs[1][1]
    assert outs[0][2] == pytest.approx(outs[1][2], abs=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_recorded_logprobs_are_the_main_models(drafted: CausalLM, device: str) -> None:
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, max_tokens=30, ignore_eos=True, seed=11)
    engine = TorchEngine(_on(drafted, device), TOK, max_batch=4, max_seq_len=96, device=device, speculative_tokens=3)
    out = _run(
        engine, [GenerationRequest(request_id=f"r{i}", prompt_ids=p, params=params) for i, p in enumerate(PROMPTS)]
    )
    assert engine.stats()["spec_accepted_tokens"] > 0
    for i, p in enumerate(PROMPTS):
        ids, lps, _ = out[f"r{i}"]
        assert len(ids) == 30
        assert lps == pytest.approx(_teacher_logprobs(drafted, p, ids, params), abs=1e-4)
        assert all(math.isfinite(x) for x in lps)


@pytest.mark.parametrize("device", DEVICES)
def test_a_weight_update_lands_between_speculative_steps(drafted: CausalLM, device: str) -> None:
    old = copy.deepcopy(drafted)  # the engine copies the update into the model it is given
    new, _ = build_tiny("micro", seed=9)
    attach_mtp(new, 3, seed=10)
    new_state = {k: v.to(device, copy=True) for k, v in new.state_dict().items()}
    assert any(k.startswith("mtp.") for k in new_state)
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=1)
    # Recomputing the cache under the new weights makes the later tokens' log-probs those of a
    # clean forward of the new model (the default keeps the old keys/values, as DESIGN says).
    engine = TorchEngine(
        old, TOK, max_batch=1, max_seq_len=96, device=device, speculative_tokens=3, recompute_kv_on_update=True
    )
    engine.submit(GenerationRequest(request_id="r", prompt_ids=PROMPTS[0], params=params))
    engine.step()
    engine.step()
    before = len(engine._slots[0].completion)  # type: ignore[union-attr]
    engine.apply_weights(1, new_state)
    assert engine.policy_version == 0
    res = {}
    while engine.has_work:
        res.update((r.request_id, r) for r in engine.step())
    r = res["r"]
    assert r.segments == [(0, before), (1, 40 - before)]
    for name, value in new_state.items():
        assert torch.equal(engine.model.state_dict()[name], value), name  # the MTP modules too
    ids = r.completion_ids
    old_lp = _teacher_logprobs(drafted, PROMPTS[0], ids, params)
    new_lp = _teacher_logprobs(new.eval(), PROMPTS[0], ids, params)
    assert r.logprobs[:before] == pytest.approx(old_lp[:before], abs=1e-4)
    assert r.logprobs[before:] == pytest.approx(new_lp[before:], abs=1e-4)
    assert engine.stats()["spec_drafted_tokens"] > 0


# ----------------------------------------------------------------------------- distribution
VOCAB = 8
STAT_PROMPT = [1, 2, 3]
DRAWS = 3000
NEW = 4  # tokens per request: the first from prefill, then drafts of up to 2


def _peaky_model() -> CausalLM:
    """A one-layer model over 8 tokens whose next-token distributions are far from uniform, with
    two random (undistilled) MTP modules whose drafts disagree with it often."""
    cfg = ModelConfig(
        model_type="llama",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        mtp_depth=2,
    )
    model = CausalLM(cfg)
    model.init_weights(torch.Generator().manual_seed(0), std=0.3)
    return model.eval()


def _exact_joint(model: CausalLM, params: SamplingParams) -> torch.Tensor:
    """P[t1, t2, t3, t4] of the main model sampling NEW tokens after STAT_PROMPT, by enumeration."""
    joint = torch.ones(())
    for n in range(NEW):
        prefixes = list(itertools.product(range(VOCAB), repeat=n))
        ids = torch.tensor([STAT_PROMPT + list(p) for p in prefixes])
        with torch.no_grad():
            logits = model(ids)[:, -1]
        probs = row_logprobs(logits, [params] * len(prefixes)).exp().reshape(*([VOCAB] * n), VOCAB)
        joint = joint[..., None] * probs
    return joint


def _draft_joint_t1_t2(model: CausalLM, params: SamplingParams) -> torch.Tensor:
    """P[t1, t2] if every first draft were accepted: p(t1) q_1(t2 | t1), the test's power check."""
    with torch.no_grad():
        h = model.hidden_states(torch.tensor([STAT_PROMPT]))[0, -1]
        p1 = row_logprobs(model(torch.tensor([STAT_PROMPT]))[:, -1], [params]).exp()[0]
        module = modules_of(model.mtp)[0]
        t1 = torch.arange(VOCAB)
        x = module(h.expand(VOCAB, -1), model.model.embed_tokens(t1))
        q = row_logprobs(model.lm_head(module.head_input(x)), [params] * VOCAB).exp()
    return p1[:, None] * q


def _chi_square_z(counts: torch.Tensor, probs: torch.Tensor, draws: int) -> float:
    """Pearson's chi-square of `counts` against `probs` (cells expecting < 5 pooled), as a
    Wilson-Hilferty z-score: about N(0, 1) when the counts follow `probs`; infinite when a cell of
    probability 0 was observed."""
    expected = probs.flatten().double() * draws
    observed = counts.flatten().double()
    small = expected < 5
    if bool(small.any()):
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
    keep = expected > 0
    if float(observed[~keep].sum()) > 0:
        return math.inf
    chi2 = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    df = int(keep.sum()) - 1
    return ((chi2 / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=5), SamplingParams(top_p=0.8)],
    ids=["t1", "t0.8-topk5", "topp0.8"],
)
def test_sampled_tokens_follow_the_main_models_distribution(params: SamplingParams, device: str) -> None:
    model = _peaky_model()
    params = SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, max_tokens=NEW, ignore_eos=True
    )
    exact = _exact_joint(model, params)
    engine = TorchEngine(
        _on(model, device), TOK, max_batch=250, max_seq_len=16, device=device, seed=17, speculative_tokens=2
    )
    out = _run(
        engine, [GenerationRequest(request_id=str(i), prompt_ids=STAT_PROMPT, params=params) for i in range(DRAWS)]
    )
    samples = torch.tensor([ids for ids, _, _ in out.values()])
    assert samples.shape == (DRAWS, NEW)
    stats = engine.stats()
    # Drafts were made at both depths and a good share of them rejected: the residual path ran.
    assert 0.2 < stats["spec_acceptance_rate"] < 0.9, stats

    def counts(*cols: int) -> torch.Tensor:
        flat = torch.zeros(VOCAB ** len(cols))
        index = sum(samples[:, c] * VOCAB ** (len(cols) - 1 - i) for i, c in enumerate(cols))
        return flat.index_add_(0, index, torch.ones(DRAWS))

    seed_note = f"engine seed 17, {DRAWS} draws, params {params}"
    z12 = _chi_square_z(counts(0, 1), exact.sum(dim=(2, 3)), DRAWS)
    z23 = _chi_square_z(counts(1, 2), exact.sum(dim=(0, 3)), DRAWS)
    z34 = _chi_square_z(counts(2, 3), exact.sum(dim=(0, 1)), DRAWS)
    z4 = _chi_square_z(counts(3), exact.sum(dim=(0, 1, 2)), DRAWS)
    assert max(z12, z23, z34, z4) < 4.0, (z12, z23, z34, z4, seed_note)
    # Power: the same statistic rejects "every first draft accepted" (the drafts' own distribution).
    z_wrong = _chi_square_z(counts(0, 1), _draft_joint_t1_t2(model, params), DRAWS)
    assert z_wrong > 10.0, (z_wrong, seed_note)
