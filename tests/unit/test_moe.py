"""Mixture-of-experts: the tiny-moe preset in engine and learner, recorded routes, router replay, the
load-balancing loss, and delta weight sync on a MoE model (LoRA on it: test_engine_lora.py)."""

from __future__ import annotations

import asyncio
import math
import random
from pathlib import Path
from typing import ClassVar

import msgspec
import pytest
import torch
import torch._dynamo  # torch.optim's first use imports it (~2 s): pay that at collection

from slipstream.engine import ByteTokenizer, CausalLM, GenerationRequest, SamplingParams, TorchEngine, build_tiny
from slipstream.engine.config import ModelConfig
from slipstream.engine.moe import (
    MoeBlock,
    aux_loss,
    force_routes,
    last_routes,
    load_balancing_loss,
    moe_blocks,
    pack_routes,
    unpack_routes,
)
from slipstream.engine.replay_mismatch import measure_replay_mismatch
from slipstream.envs import Environment, Problem, Score, StepResult, TaskSpec, Transcript
from slipstream.harness import rollout_episodes
from slipstream.learner.config import LearnerSection
from slipstream.learner.trainer import Trainer
from slipstream.rl import LossConfig, TrainItem, pack_batch
from slipstream.schemas import PolicySegment, Sample, ScoredEpisode, pack_floats, pack_ids, pack_mask
from slipstream.schemas.episode import Episode as EpisodeRecord
from slipstream.store import LocalObjectStore
from slipstream.weights import load_version, publish_version

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

TOK = ByteTokenizer()
WIDTH = 4 * 2  # tiny-moe: 4 MoE layers x top-2


@pytest.fixture(scope="module")
def moe() -> CausalLM:
    model, _ = build_tiny("tiny-moe", seed=3)
    return model.eval()


def _full_routes(model: CausalLM, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        model(torch.tensor([ids]))
    return last_routes(moe_blocks(model))[0]


def test_the_preset_has_eight_top2_experts_under_qwen_moe_names(moe: CausalLM) -> None:
    names = dict(moe.named_parameters())
    assert names["model.layers.0.mlp.gate.weight"].shape == (8, 128)
    assert names["model.layers.3.mlp.experts.7.down_proj.weight"].shape == (128, 256)
    assert "model.layers.0.mlp.gate_proj.weight" not in names
    blocks = moe_blocks(moe)
    assert len(blocks) == 4 and all(b.top_k == 2 and b.num_experts == 8 for b in blocks)
    assert sum(p.numel() for p in moe.parameters()) == 3_413_888
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(3\) <= num_experts \(2\)"):
        msgspec.structs.replace(moe.config, num_experts=2, num_experts_per_tok=3)


def test_config_round_trips_through_config_json() -> None:
    cfg = build_tiny("tiny-moe")[0].config
    back = ModelConfig.from_hf(cfg.to_hf())
    assert back == cfg and back.num_experts == 8 and back.num_experts_per_tok == 2


def test_cached_forward_equals_the_full_forward_and_caches_its_routes(moe: CausalLM) -> None:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (3, 14), generator=gen)
    lengths = [14, 9, 11]
    cache = moe.new_cache(slots=4, max_seq_len=32)
    slots = [2, 0, 3]
    with torch.no_grad():
        for row, (n, slot) in enumerate(zip(lengths, slots, strict=True)):
            moe.forward_cached(ids[row : row + 1, : n - 1], torch.arange(n - 1)[None], cache, [slot])
        last = torch.stack([ids[r, n - 1] for r, n in enumerate(lengths)])[:, None]
        pos = torch.tensor([[n - 1] for n in lengths])
        step = moe.forward_cached(last, pos, cache, slots)
        for row, (n, slot) in enumerate(zip(lengths, slots, strict=True)):
            full = moe(ids[row : row + 1, :n])
            torch.testing.assert_close(step[row, 0], full[0, -1], rtol=0, atol=2e-5)
            assert torch.equal(cache.routes[slot, :n].long(), last_routes(moe_blocks(moe))[0])  # type: ignore[index]


def test_engine_results_carry_the_routes_and_logprobs_the_learner_computes(moe: CausalLM) -> None:
    engine = TorchEngine(moe, TOK, max_batch=4, max_seq_len=64, device="cpu", mkl_pack=False)
    prompt = [TOK.BOS, *TOK.encode("route me ")]
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    # Two rows with one prompt (the second copies the first's cache) and one with another prompt.
    for rid, p in (("a", prompt), ("b", prompt), ("c", [TOK.BOS, *TOK.encode("other")])):
        engine.submit(GenerationRequest(request_id=rid, prompt_ids=p, params=msgspec.structs.replace(params, seed=7)))
    results = {}
    while engine.has_work:
        results.update((r.request_id, r) for r in engine.step())
    for res in results.values():
        tokens = [*res.prompt_ids, *res.completion_ids]
        assert res.routes_per_token == WIDTH
        recorded = unpack_routes(res.routes, WIDTH)
        assert recorded.shape == (len(tokens) - 1, WIDTH)  # every token but the last was forwarded
        assert torch.equal(recorded, _full_routes(moe, tokens[:-1]))
        with torch.no_grad():
            logits = moe(torch.tensor([tokens]))[0, len(res.prompt_ids) - 1 : -1]
        mine = logits.log_softmax(-1).gather(1, torch.tensor(res.completion_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(res.logprobs), mine, rtol=0, atol=2e-5)


def test_forcing_the_recorded_routes_changes_nothing_and_other_routes_change_the_logits(moe: CausalLM) -> None:
    ids = torch.tensor([[TOK.BOS, *TOK.encode("replay these routes")]])
    with torch.no_grad():
        own = moe(ids)
        recorded = last_routes(moe_blocks(moe))
        with force_routes(moe, recorded):
            replayed = moe(ids)
            assert torch.equal(last_routes(moe_blocks(moe)), recorded)
        # The order of a token's k choices does not matter, and −1 means "route yourself".
        swapped = recorded.view(1, -1, 4, 2).flip(-1).reshape(recorded.shape)
        assert not torch.equal(swapped, recorded)
        with force_routes(moe, swapped):
            assert torch.equal(moe(ids), own)
        with force_routes(moe, torch.full_like(recorded, -1)):
            assert torch.equal(moe(ids), own)
        other = (recorded + 3) % 8
        with force_routes(moe, other):
            changed = moe(ids)
            assert torch.equal(last_routes(moe_blocks(moe)), other)
        after = moe(ids)
    assert torch.equal(replayed, own)
    assert (changed - own).abs().max() > 1e-2
    assert torch.equal(after, own)  # the routes are forced only inside the block
    assert all(b.forced is None for b in moe_blocks(moe))


def test_force_routes_refuses_routes_that_do_not_fit_the_model(moe: CausalLM) -> None:
    narrow = torch.zeros(1, 3, 6, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"needs \[B, T, 8\] \(4 MoE layers x top-2\)"), force_routes(moe, narrow):
        pass
    past = torch.full((1, 3, 8), 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="names expert 8; this model has 8 experts"), force_routes(moe, past):
        pass
    dense, _ = build_tiny("tiny")
    with force_routes(dense, torch.zeros(1, 3, 8, dtype=torch.int64)):  # a dense model has nothing to force
        pass


def test_load_balancing_loss_on_hand_built_routes() -> None:
    # 2 experts, top-1, three tokens: P = (0.7, 0.3) over the first two; both go to expert 0, so f = (1, 0).
    probs = torch.tensor([[0.8, 0.2], [0.6, 0.4], [0.1, 0.9]])
    routes = torch.tensor([[0], [0], [1]])
    mask = torch.tensor([True, True, False])
    assert float(load_balancing_loss(probs, routes, 2, mask)) == pytest.approx(2 * (1.0 * 0.7 + 0.0 * 0.3))
    # All three: f = (2/3, 1/3), P = (0.5, 0.5) -> 2 * (1/3 + 1/6) = 1.
    assert float(load_balancing_loss(probs, routes, 2)) == pytest.approx(1.0)
    # Top-2 of 4, uniform probabilities, every expert used equally: the balanced value 1.
    uniform = torch.full((2, 4), 0.25)
    assert float(load_balancing_loss(uniform, torch.tensor([[0, 1], [2, 3]]), 4)) == pytest.approx(1.0)
    # Everything on expert 0 with probability ~1: the worst case, E.
    peaked = torch.tensor([[1.0, 0.0, 0.0, 0.0]] * 3)
    assert float(load_balancing_loss(peaked, torch.tensor([[0]] * 3), 4)) == pytest.approx(4.0)
    assert float(load_balancing_loss(probs, routes, 2, torch.zeros(3, dtype=torch.bool))) == 0.0


def test_aux_loss_is_the_mean_over_layers_and_none_for_a_dense_model(moe: CausalLM) -> None:
    ids = torch.tensor([[TOK.BOS, *TOK.encode("balance")]])
    with torch.no_grad():
        moe(ids)
    per_layer = [load_balancing_loss(b.last_probs, b.last_routes, 8) for b in moe_blocks(moe)]  # type: ignore[arg-type]
    total = aux_loss(moe)
    assert total is not None and float(total) == pytest.approx(float(torch.stack(per_layer).mean()))
    assert 1.0 <= float(total) < 8.0
    dense, _ = build_tiny("tiny")
    dense(ids)
    assert aux_loss(dense) is None


def test_routes_pack_into_one_byte_per_entry() -> None:
    routes = torch.tensor([[0, 7, 3, 255], [1, 2, 4, 5]])
    data = pack_routes(routes)
    assert data == bytes([0, 7, 3, 255, 1, 2, 4, 5])
    assert torch.equal(unpack_routes(data, 4), routes)
    assert unpack_routes(b"", 4).shape == (0, 4)
    with pytest.raises(ValueError, match="7 route bytes are not a whole number of tokens of width 4"):
        unpack_routes(bytes(7), 4)


def test_pack_batch_lays_routes_on_input_positions_and_pads_with_minus_one() -> None:
    a = TrainItem(
        token_ids=[1, 2, 3, 4], prompt_len=2, behaviour_logprobs=[-1.0, -1.0], loss_mask=[1, 1], advantage=1.0,
        routes=bytes([5, 6, 7, 0, 1, 2]), routes_per_token=2,
    )  # fmt: skip
    b = TrainItem(token_ids=[1, 2, 3], prompt_len=1, behaviour_logprobs=[-1.0, -1.0], loss_mask=[1, 1], advantage=0.0)
    batch = pack_batch([a, b])
    assert batch.routes is not None and batch.routes.shape == (2, 4, 2)
    assert batch.routes[0].tolist() == [[5, 6], [7, 0], [1, 2], [-1, -1]]
    assert (batch.routes[1] == -1).all()
    assert pack_batch([b]).routes is None
    wide = TrainItem(**{**a.__dict__, "routes": bytes(12), "routes_per_token": 4})
    with pytest.raises(ValueError, match=r"routes of different widths \[2, 4\]"):
        pack_batch([a, wide])
    with pytest.raises(ValueError, match="routes for 5 tokens, 4 tokens"):
        pack_batch([TrainItem(**{**a.__dict__, "routes": bytes(10)})])


def _episode(eid: str, res_tokens: list[int], prompt_len: int, logprobs: list[float], routes: bytes) -> ScoredEpisode:
    n = len(res_tokens) - prompt_len
    sample = Sample(
        sample_id=eid,
        prompt_len=prompt_len,
        token_ids=pack_ids(res_tokens),
        logprobs=pack_floats(logprobs),
        loss_mask=pack_mask([1] * n),
        segments=[PolicySegment(0, n)],
        routes=routes,
        routes_per_token=WIDTH if routes else 0,
    )
    episode = EpisodeRecord(episode_id=eid, task_id="t", env="reverse", group_id="g", group_size=2, samples=[sample])
    return ScoredEpisode(episode=episode, reward=float(eid == "a"), correct=eid == "a")


def _sampled_group(model: CausalLM, dtype: torch.dtype) -> list[ScoredEpisode]:
    served = model.to(dtype=dtype)
    engine = TorchEngine(served, TOK, max_batch=2, max_seq_len=64, device="cpu", dtype=dtype)
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    for i, rid in enumerate("ab"):
        prompt = [TOK.BOS, *TOK.encode(f"tokens {i} to route")]
        engine.submit(
            GenerationRequest(request_id=rid, prompt_ids=prompt, params=msgspec.structs.replace(params, seed=i))
        )
    out = {}
    while engine.has_work:
        out.update((r.request_id, r) for r in engine.step())
    return [
        _episode(rid, [*r.prompt_ids, *r.completion_ids], len(r.prompt_ids), list(r.logprobs), r.routes)
        for rid, r in sorted(out.items())
    ]


def _trainer(model: CausalLM, **section: object) -> Trainer:
    return Trainer(model, LearnerSection(**section), LossConfig(), pad_id=TOK.pad_id)  # type: ignore[arg-type]


def test_the_learner_replays_recorded_routes_only_when_asked() -> None:
    model, _ = build_tiny("tiny-moe", seed=4)
    group = _sampled_group(model, torch.float32)
    batch = pack_batch([i for s in group for i in _items(s)])
    t = _trainer(model, router_replay=True)
    with torch.no_grad():
        free = t._logprobs(model, batch)
        replayed = t._logprobs(model, batch, replay=True)
        # The forward ran on the recorded routes wherever the engine recorded one.
        assert batch.routes is not None
        seen = batch.routes >= 0
        assert torch.equal(last_routes(moe_blocks(model))[seen], batch.routes[seen])
        # The fp32 engine and the learner agree on every route: replay changes no log-prob.
        torch.testing.assert_close(replayed, free, rtol=0, atol=1e-6)
        shifted = pack_batch([i for s in group for i in _items(s, shift=1)])
        moved = t._logprobs(model, shifted, replay=True)
        assert (moved - free)[batch.mask].abs().max() > 1e-3
        assert torch.equal(t._logprobs(model, shifted), free)  # replay off: the routes are not used
    stats = t.step([group], version=0)
    assert stats.applied
    assert stats.figures["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # engine and learner agree


def _items(s: ScoredEpisode, shift: int = 0) -> list[TrainItem]:
    sample = s.episode.samples[0]
    routes = sample.routes if not shift else bytes((b + shift) % 8 for b in sample.routes)
    return [
        TrainItem(
            token_ids=sample.ids(),
            prompt_len=sample.prompt_len,
            behaviour_logprobs=sample.behaviour_logprobs(),
            loss_mask=sample.mask(),
            advantage=0.0,
            routes=routes,
            routes_per_token=sample.routes_per_token,
        )
    ]


def test_the_aux_loss_is_added_at_its_coefficient_and_reported() -> None:
    def router_grad(coef: float) -> tuple[torch.Tensor, dict[str, float]]:
        model, _ = build_tiny("tiny-moe", seed=5)
        group = [
            _episode(eid, [TOK.BOS, 40, 41, 42, 43 + i, 44], 4, [-math.log(259.0)] * 2, b"")
            for i, eid in enumerate("ab")
        ]
        t = _trainer(model, moe_aux_coef=coef)
        sums, _ = t.accumulate([[i for s in group for i in _items(s)]], total_tokens=4)
        gate = model.get_submodule("model.layers.0.mlp.gate").weight.grad
        assert gate is not None
        return gate.clone(), sums

    base, sums0 = router_grad(0.0)
    with_aux, sums1 = router_grad(1.0)
    assert sums0["moe_aux_loss"] == pytest.approx(sums1["moe_aux_loss"])
    assert 1.0 <= sums1["moe_aux_loss"] / sums1["tokens"] < 8.0  # a token-weighted mean, per trained token
    assert (with_aux - base).abs().max() > 1e-6
    dense, _ = build_tiny("tiny")
    group = [_episode(eid, [TOK.BOS, 40, 41, 42, 43, 44], 4, [-1.0, -1.0], b"") for eid in "ab"]
    stats = Trainer(dense, LearnerSection(), LossConfig(), pad_id=TOK.pad_id).step([group], version=0)
    assert "moe_aux_loss" not in stats.figures


def test_bf16_sampling_mismatch_is_measured_with_and_without_replay() -> None:
    control = measure_replay_mismatch(requests=4, max_tokens=16, engine_dtype=torch.float32)
    assert control["tokens"] == 64 and control["route_flip_share"] == 0.0
    assert control["no_replay"]["max_abs_logprob_diff"] < 1e-4
    assert control["replay"] == pytest.approx(control["no_replay"], abs=1e-6)
    bf16 = measure_replay_mismatch(requests=4, max_tokens=16)
    assert bf16["engine_dtype"] == "bfloat16" and bf16["no_replay"]["max_abs_logprob_diff"] > 1e-4
    assert 0.0 <= bf16["route_flip_share"] <= 1.0
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        measure_replay_mismatch(build_tiny("tiny")[0])


class _TwoTurn(Environment[msgspec.Struct]):
    """The first output gets an observation back, the second ends the episode."""

    class Options(msgspec.Struct, frozen=True):
        pass

    name: ClassVar[str] = "twoturn"
    components: ClassVar[tuple[str, ...]] = ("done",)
    max_turns: ClassVar[int] = 2

    def sample(self, rng: random.Random) -> Problem:
        return Problem(key="k", prompt="go:", reference="x")

    def transition(self, episode: Transcript, model_output: str) -> StepResult:
        return (
            StepResult(observation="<obs>", done=False)
            if episode.turns == 1
            else StepResult(observation=None, done=True)
        )

    def grade(self, task: TaskSpec, completion: str) -> Score:
        return Score.of({"done": 1.0}, correct=True, parse_ok=True, reason="ok")


def test_a_multi_turn_episode_records_the_routes_of_its_whole_sample(moe: CausalLM) -> None:
    async def play() -> list[EpisodeRecord]:
        engine = TorchEngine(moe, TOK, max_batch=2, max_seq_len=128, device="cpu")
        await engine.start()
        try:
            spec = TaskSpec(task_id="t", env="twoturn", prompt="go:", reference="x", seed=0, split="train")
            params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
            return await rollout_episodes(engine, TOK, _TwoTurn(), spec, group_size=1, params=params, group_id="g")
        finally:
            await engine.stop()

    (episode,) = asyncio.run(play())
    (sample,) = episode.samples
    tokens = sample.ids()
    assert sample.routes_per_token == WIDTH
    recorded = unpack_routes(sample.routes, WIDTH)
    # The second turn's prefill routed the first turn's completion and the observation: all but the last token.
    assert recorded.shape[0] == len(tokens) - 1
    assert torch.equal(recorded, _full_routes(moe, tokens[:-1]))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(episode), type=EpisodeRecord)
    assert back.samples[0].routes == sample.routes


def test_delta_weight_sync_on_a_moe_model_is_bit_exact_and_serves_the_learners_logits(tmp_path: Path) -> None:
    learner, _ = build_tiny("tiny-moe", seed=6)
    opt = torch.optim.AdamW(learner.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    store = LocalObjectStore(tmp_path / "store")
    versions = []
    for v in range(3):
        versions.append({k: t.detach().clone() for k, t in learner.state_dict().items()})
        base = None if v == 0 else (v - 1, versions[v - 1])
        publish_version(store, run_id="r", version=v, tensors=versions[v], base=base, keyframe_every=10, threads=1)
        x = torch.randint(0, 259, (2, 12), generator=gen)
        logits = learner(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 259), x[:, 1:].reshape(-1))
        loss = loss + 0.1 * aux_loss(learner)  # type: ignore[operator]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    held = load_version(store, "r", 0)
    for v in (1, 2):
        held = load_version(store, "r", v, have=(v - 1, held))
        assert all(torch.equal(held[k], versions[v][k]) for k in versions[v]), f"version {v} not bit-exact"
    assert any(not torch.equal(versions[2][k], versions[0][k]) for k in versions[0] if ".experts." in k)
    serving, _ = build_tiny("tiny-moe", seed=6)
    engine = TorchEngine(serving, TOK, max_batch=1, max_seq_len=32, device="cpu", allow_partial_updates=True)
    engine.apply_weights(2, held)
    prompt = [TOK.BOS, *TOK.encode("sync")]
    engine.submit(
        GenerationRequest(
            request_id="r", prompt_ids=prompt, params=SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        )
    )
    res = None
    while engine.has_work:
        for r in engine.step():
            res = r
    assert res is not None and res.segments == [(2, 6)]
    reference, _ = build_tiny("tiny-moe", seed=0)
    reference.load_state_dict(versions[2])
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(reference(torch.tensor([ids]))[0, -1].argmax()))
    assert res.completion_ids == ids[len(prompt) :]
    assert isinstance(moe_blocks(serving)[0], MoeBlock)


def test_the_bench_section_reports_bf16_and_fp32_rows_per_seed(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from slipstream.bench.moe import moe_section

    args = argparse.Namespace(
        no_moe=False, moe_model="tiny-moe", moe_seeds=[0, 1], moe_requests=2, moe_new=4, device="cpu"
    )
    out = moe_section(args)
    assert out is not None
    assert [(r["engine_dtype"], r["seed"], r["tokens"]) for r in out["rows"]] == [
        ("bfloat16", 0, 8),
        ("bfloat16", 1, 8),
        ("float32", 0, 8),
        ("float32", 1, 8),
    ]
    assert "MoE router replay (tiny-moe)" in capsys.readouterr().out
    assert moe_section(argparse.Namespace(no_moe=True)) is None


def test_router_replay_in_a_run_file_reaches_the_learner(tmp_path: Path) -> None:
    from slipstream.learner.config import LearnerConfig
    from slipstream.run import load, service_env
    from slipstream.runtime.config import resolve

    path = tmp_path / "moe.toml"
    path.write_text(
        'name = "moe"\n[model]\npreset = "tiny-moe"\n[learner]\nrouter_replay = true\nmoe_aux_coef = 0.05\n'
    )
    plan = load(path).plan()
    assert plan.preset == "tiny-moe" and plan.router_replay and plan.moe_aux_coef == 0.05
    learner = resolve(LearnerConfig, environ=service_env(plan, Path("/m"), Path("/s"), Path("/o"))).learner
    assert learner.router_replay is True and learner.moe_aux_coef == 0.05
    path.write_text('name = "moe"\n[model]\npreset = "tiny-moe"\n')
    default = resolve(LearnerConfig, environ=service_env(load(path).plan(), Path("/m"), Path("/s"), Path("/o")))
    assert default.learner.router_replay is False and default.learner.moe_aux_coef == 0.01
