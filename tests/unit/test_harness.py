"""The rollout harness: rollout_group's trajectories, the multi-turn contract, evaluate, the SFT
warm-start, and the shared `[model]` section (slipstream.engine.source)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import ClassVar

import msgspec
import pytest
import torch

from slipstream.engine import ByteTokenizer, CausalLM, SamplingParams, TorchEngine, build_tiny
from slipstream.engine.presets import PRESETS
from slipstream.engine.source import PRESET_NAMES, ModelSource, load_model
from slipstream.envs import Environment, Problem, Score, StepResult, TaskSpec, Transcript, get_env
from slipstream.harness import RolloutAborted, TaskRejected, evaluate, prompt_ids, rollout_group
from slipstream.schemas import Task, Trajectory, decode, encode
from slipstream.supervised import sft_sequence, sft_warmstart

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

TOK = ByteTokenizer()
ARITH = get_env("arith")


@pytest.fixture(scope="module")
def model() -> CausalLM:
    m, _ = build_tiny("tiny", seed=5)
    return m.eval()


@pytest.fixture
async def engine(model: CausalLM) -> AsyncIterator[TorchEngine]:
    eng = TorchEngine(model, TOK, max_batch=8, max_seq_len=256, device="cpu")
    await eng.start()
    yield eng
    await eng.stop()


def _task(group_size: int = 4) -> Task:
    spec = ARITH.generate("train", 1, seed=7)[0]
    return spec.to_task(run_id="run-a", group_size=group_size)


def _check_arrays(t: Trajectory) -> int:
    n = t.completion_len()
    assert n >= 1
    assert len(t.behaviour_logprobs()) == n
    assert len(t.mask()) == n
    assert sum(s.n_tokens for s in t.segments) == n
    assert all(s.n_tokens > 0 for s in t.segments)
    return n


async def test_rollout_group_yields_one_consistent_trajectory_per_completion(engine: TorchEngine) -> None:
    task = _task(group_size=4)
    params = SamplingParams(temperature=1.0, max_tokens=12)
    trajs = await rollout_group(engine, TOK, ARITH, task, params=params, worker_id="w0", group_id="g1")
    assert len(trajs) == 4
    assert [t.trajectory_id for t in trajs] == [f"g1/{i}" for i in range(4)]
    prompt = [TOK.BOS, *TOK.encode(task.prompt)]
    for i, t in enumerate(trajs):
        n = _check_arrays(t)
        assert t.prompt_len == len(prompt)
        assert t.ids()[: t.prompt_len] == prompt
        assert t.mask() == [1] * n
        assert all(lp <= 0.0 for lp in t.behaviour_logprobs())
        assert t.versions() == [0]
        completion = t.ids()[t.prompt_len :]
        assert t.completion_text == TOK.decode([c for c in completion if c != TOK.EOS])
        assert t.finish_reason == ("stop" if completion[-1] == TOK.EOS else "length")
        assert n <= 12
        assert (t.group_index, t.group_size, t.group_id) == (i, 4, "g1")
        assert (t.task_id, t.env, t.run_id, t.worker_id) == (task.task_id, "arith", "run-a", "w0")
        assert (t.split, t.reference) == (task.split, task.reference)
        assert t.timings.finished_at >= t.timings.started_at >= t.timings.queued_at > 0
        assert [(turn.role, turn.start, turn.end) for turn in t.turns] == [("policy", t.prompt_len, t.prompt_len + n)]
        # It survives the wire.
        assert decode(encode(t), Trajectory) == t
    # Distinct seeds: four samples of a random model at temperature 1 are not all the same.
    assert len({t.token_ids for t in trajs}) > 1


async def test_rollout_group_is_reproducible_from_group_id(engine: TorchEngine) -> None:
    task = _task(group_size=3)
    params = SamplingParams(temperature=1.0, max_tokens=10)
    a = await rollout_group(engine, TOK, ARITH, task, params=params, group_id="same")
    b = await rollout_group(engine, TOK, ARITH, task, params=params, group_id="same")
    c = await rollout_group(engine, TOK, ARITH, task, params=params)
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    assert c[0].group_id.startswith(task.task_id + "/") and c[0].group_id != "same"


async def test_rollout_group_records_a_weight_update_mid_completion(engine: TorchEngine, model: CausalLM) -> None:
    spec = ARITH.generate("train", 1, seed=3)[0]
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    job = asyncio.create_task(rollout_group(engine, TOK, ARITH, spec, group_size=2, params=params))
    while engine.stats()["tokens_generated"] < 4:
        await asyncio.sleep(0.002)
    engine.apply_weights(1, {k: v.clone() for k, v in model.state_dict().items()})
    trajs = await job
    for t in trajs:
        assert _check_arrays(t) == 40
        assert t.versions() == [0, 1]
        assert t.oldest_version() == 0


async def test_rollout_group_rejects_tasks_it_can_never_run(model: CausalLM) -> None:
    eng = TorchEngine(model, TOK, max_batch=2, max_seq_len=4, device="cpu")
    await eng.start()
    try:
        params = SamplingParams(max_tokens=4)
        with pytest.raises(TaskRejected, match="max_seq_len 4"):
            await rollout_group(eng, TOK, ARITH, _task(), params=params)
        with pytest.raises(TaskRejected, match="not 'reverse'"):
            await rollout_group(eng, TOK, get_env("reverse"), _task(), params=params)
        with pytest.raises(TaskRejected, match="group_size must be >= 1"):
            await rollout_group(eng, TOK, ARITH, _task(), group_size=0, params=params)
        bad = msgspec.structs.replace(_task(), split="dev")
        with pytest.raises(TaskRejected, match="split 'dev'"):
            await rollout_group(eng, TOK, ARITH, bad, params=params)
    finally:
        await eng.stop()


async def test_rollout_group_raises_aborted_when_the_engine_stops(model: CausalLM) -> None:
    eng = TorchEngine(model, TOK, max_batch=2, max_seq_len=512, device="cpu")
    await eng.start()
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    job = asyncio.create_task(rollout_group(eng, TOK, ARITH, _task(), group_size=2, params=params))
    while eng.stats()["tokens_generated"] < 2:
        await asyncio.sleep(0.002)
    await eng.stop()
    with pytest.raises(RolloutAborted):
        await job


class _TwoTurn(Environment[msgspec.Struct]):
    """A test env: the first output gets an observation back, the second ends the episode."""

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


async def test_multi_turn_rollout_masks_observations_and_records_turns(engine: TorchEngine) -> None:
    env = _TwoTurn()
    spec = TaskSpec(task_id="t2", env="twoturn", prompt="go:", reference="x", seed=0, split="train")
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    (t,) = await rollout_group(engine, TOK, env, spec, group_size=1, params=params, group_id="mt")
    n = _check_arrays(t)
    obs = TOK.encode("<obs>")
    assert n == 5 + len(obs) + 5
    assert t.mask() == [1] * 5 + [0] * len(obs) + [1] * 5
    lps = t.behaviour_logprobs()
    assert lps[5 : 5 + len(obs)] == [0.0] * len(obs)
    assert all(lp < 0.0 for lp in lps[:5] + lps[5 + len(obs) :])
    assert t.ids()[t.prompt_len + 5 : t.prompt_len + 5 + len(obs)] == obs
    p = t.prompt_len
    assert [(x.role, x.start, x.end) for x in t.turns] == [
        ("policy", p, p + 5),
        ("observation", p + 5, p + 5 + len(obs)),
        ("policy", p + 5 + len(obs), p + n),
    ]
    assert "<obs>" in t.completion_text
    assert t.versions() == [0] and t.finish_reason == "length"


async def test_evaluate_scores_every_task_with_the_env_verifier(engine: TorchEngine) -> None:
    tasks = ARITH.generate("heldout", 6, seed=2)
    report = await evaluate(engine, TOK, ARITH, tasks, concurrency=3)
    assert (report.env, report.n_tasks, report.samples_per_task, report.n) == ("arith", 6, 1, 6)
    assert 0.0 <= report.accuracy <= 1.0
    assert [r.task_id for r in report.tasks] == [t.task_id for t in tasks]
    for rec, spec in zip(report.tasks, tasks, strict=True):
        assert len(rec.completions) == 1
        score = ARITH.score(spec, rec.completions[0])
        assert (rec.rewards[0], rec.correct[0], rec.parse_ok[0]) == (score.reward, score.correct, score.parse_ok)
    assert report.accuracy == sum(r.correct[0] for r in report.tasks) / 6
    assert report.mean_reward == pytest.approx(sum(r.rewards[0] for r in report.tasks) / 6)
    assert report.parse_failures == sum(not r.parse_ok[0] for r in report.tasks)
    assert report.policy_versions == [0]
    # Greedy: the same weights give the same answers.
    again = await evaluate(engine, TOK, ARITH, tasks, samples_per_task=2)
    assert again.n == 12
    assert [r.completions[0] for r in again.tasks] == [r.completions[0] for r in report.tasks]
    assert all(r.completions[0] == r.completions[1] for r in again.tasks)
    with pytest.raises(ValueError, match="at least one task"):
        await evaluate(engine, TOK, ARITH, [])


def test_sft_sequence_is_laid_out_like_a_rollout() -> None:
    spec = ARITH.generate("train", 1, seed=1)[0]
    ids, prompt_len = sft_sequence(TOK, ARITH, spec)
    assert prompt_len == len(prompt_ids(TOK, spec.prompt)) == 1 + len(spec.prompt)
    assert ids == [TOK.BOS, *TOK.encode(spec.prompt), *TOK.encode(spec.reference + "\n"), TOK.EOS]


@pytest.fixture(scope="module")
def _optimizers_imported() -> None:
    # torch's first optimizer construction imports its compile machinery (~2 s, once per
    # process); pay it in setup so the test measures the warm-start itself.
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])


@pytest.mark.usefixtures("_optimizers_imported")
def test_sft_warmstart_lowers_the_loss() -> None:
    m, _ = build_tiny("tiny", seed=1)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    report = sft_warmstart(m, TOK, ARITH, steps=8, batch_size=4, lr=3e-3, seed=0, warmup_steps=2)
    assert (report["steps"], report["examples"], len(report["losses"])) == (8, 32, 8)
    assert report["tokens"] >= 32 * 3  # answer digit(s) + terminator + eos per example
    assert report["loss_last"] < report["loss_first"] - 0.5
    assert not m.training
    assert any(not torch.equal(before[k], v) for k, v in m.state_dict().items())
    with pytest.raises(ValueError, match="steps and batch_size"):
        sft_warmstart(m, TOK, ARITH, steps=0)


def test_greedy_accuracy_is_teacher_forced_argmax_exact_match() -> None:
    from slipstream.supervised.warmstart import greedy_accuracy, sft_sequence

    m, _ = build_tiny("micro", seed=3)
    env = get_env("reverse", min_len=3, max_len=3)
    examples = []
    for t in env.generate("train", 6, 0):
        prompt, _ = sft_sequence(TOK, env, t)
        prompt = prompt[: len(prompt) - 5]  # [bos] + "rev abc=" only: drop the reference and eos
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(4):  # the model's own greedy continuation is, by definition, all argmax
                ids.append(int(m(torch.tensor([ids])).argmax(-1)[0, -1]))
        examples.append((ids, [False] * len(prompt) + [True] * 4))
    assert greedy_accuracy(m, examples, TOK.pad_id) == 1.0
    # Change the third trained token of two examples: those two are no longer greedy's output.
    for i in (1, 4):
        ids, trained = examples[i]
        k = len(ids) - 2
        examples[i] = ([*ids[:k], (ids[k] + 1) % 256, *ids[k + 1 :]], trained)
    assert m.training
    assert greedy_accuracy(m, examples, TOK.pad_id) == pytest.approx(4 / 6)
    assert m.training  # left in the mode it was in


def test_greedy_success_counts_an_item_only_when_all_its_turns_are_argmax() -> None:
    from slipstream.supervised.warmstart import greedy_success, sft_sequence

    m, _ = build_tiny("micro", seed=3)
    env = get_env("reverse", min_len=3, max_len=3)
    examples = []
    for t in env.generate("train", 6, 0):
        prompt = sft_sequence(TOK, env, t)[0][:-5]
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(4):
                ids.append(int(m(torch.tensor([ids])).argmax(-1)[0, -1]))
        examples.append((ids, [False] * len(prompt) + [True] * 4))
    items = [examples[0:2], examples[2:4], examples[4:6]]
    assert greedy_success(m, items, TOK.pad_id) == 1.0
    # One wrong turn fails its whole item (an episode greedy would not replay), not the others.
    ids, trained = examples[3]
    items[1][1] = ([*ids[:-1], (ids[-1] + 1) % 256], trained)
    assert greedy_success(m, items, TOK.pad_id) == pytest.approx(2 / 3)
    assert greedy_success(m, items, TOK.pad_id, batch_size=1) == pytest.approx(2 / 3)


def test_probe_success_is_greedy_and_sampled_success_from_one_pass() -> None:
    from slipstream.supervised.warmstart import greedy_success, probe_items, probe_success, sampled_success

    env = get_env("lookup", expert_guess_rate=0.3, expert_slip_rate=0.4)
    items = probe_items(env, TOK, env.generate("train", 48, 5))
    m, _ = build_tiny("micro", seed=3)
    # The untrained model is at 0 on both; a model that has seen the episodes is not.
    sft_warmstart(m, TOK, env, steps=30, batch_size=8, seed=0)
    for model in (build_tiny("micro", seed=3)[0], m):
        for t in (1.0, 0.5):
            got = probe_success(model, items, TOK.pad_id, t, batch_size=7)
            assert got == (greedy_success(model, items, TOK.pad_id, 7), sampled_success(model, items, TOK.pad_id, t, 7))
    assert probe_success(m, items, TOK.pad_id)[1] > 0.0
    with pytest.raises(ValueError, match="temperature"):
        probe_success(m, items, TOK.pad_id, 0.0)


def test_probe_items_of_an_imperfect_expert_are_its_clean_episodes() -> None:
    from slipstream.supervised.warmstart import probe_items

    env = get_env("lookup", expert_guess_rate=0.3, expert_slip_rate=0.4)
    tasks = env.generate("train", 64, 5)
    items = probe_items(env, TOK, tasks)
    clean = [
        t for t in tasks if env._draw(t.metadata["key"], "guess") >= 0.3 and env._draw(t.metadata["key"], "slip") >= 0.4
    ]
    assert 0 < len(items) == len(clean) < len(tasks)
    # One sample per episode whose trained tokens are the well-formed call and the right answer
    # (the result between them is observation, not trained): no guess, no malformed call.
    for item, t in zip(items, clean, strict=True):
        assert len(item) == 1
        ids, trained = item[0]
        sampled = TOK.decode([i for i, m in zip(ids, trained, strict=True) if m])
        assert sampled.startswith(env.call_text(t.metadata["key"]) + t.reference + "\n"), sampled
    with pytest.raises(ValueError, match="solved none"):
        probe_items(get_env("lookup", expert_guess_rate=1.0), TOK, tasks)


class _FixedLogits(torch.nn.Module):
    """Every position predicts the same logits over a 4-token vocabulary: log([1, 1, 1, 3])."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.log(torch.tensor([1.0, 1.0, 1.0, 3.0])))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.expand(*ids.shape, 4)


def test_sampled_success_is_the_mean_probability_of_replaying_each_item() -> None:
    from slipstream.supervised.warmstart import sampled_success

    m = _FixedLogits()
    # At T=1 token 3 has p = 3/6 = 1/2 and any other 1/6. Item A: one sample, three trained 3s:
    # (1/2)^3 = 1/8. Item B: two samples (turns) of one trained token each, a 3 and a 2:
    # 1/2 * 1/6 = 1/12. The prompt token (untrained) and the padding count for nothing.
    items = [[([1, 3, 3, 3], [False, True, True, True])], [([1, 3], [False, True]), ([1, 2], [False, True])]]
    assert sampled_success(m, items, pad_id=0) == pytest.approx((1 / 8 + 1 / 12) / 2)
    assert sampled_success(m, items, pad_id=0, batch_size=1) == pytest.approx((1 / 8 + 1 / 12) / 2)
    # At T=0.5 the logits double: weights [1, 1, 1, 9], so p(3) = 3/4 and p(2) = 1/12.
    assert sampled_success(m, items, pad_id=0, temperature=0.5) == pytest.approx(((3 / 4) ** 3 + 3 / 4 / 12) / 2)
    assert m.training  # left in the mode it was in
    with pytest.raises(ValueError, match="temperature"):
        sampled_success(m, items, pad_id=0, temperature=0.0)


@pytest.mark.usefixtures("_optimizers_imported")
def test_without_a_sampled_target_the_greedy_target_alone_stops_the_warm_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A probe that meets the greedy target at once stops at the first check (the reverse demo's
    # plan has no sampled target; a stop that also waited for one would run every seed to the cap).
    import slipstream.supervised.warmstart as ws

    monkeypatch.setattr(ws, "greedy_success", lambda *a, **k: 1.0)
    env = get_env("reverse", min_len=3, max_len=3)
    m, _ = build_tiny("micro", seed=1)
    out = sft_warmstart(m, TOK, env, steps=8, batch_size=4, seed=0, target_accuracy=0.2, probe_tasks=16)
    assert (out["steps"], out["reached"], out["probe_curve"]) == (2, True, [[2, 1.0]])
    assert "probe_sampled" not in out


@pytest.mark.usefixtures("_optimizers_imported")
def test_sft_warmstart_stops_at_its_target_or_its_cap() -> None:
    env = get_env("reverse", min_len=3, max_len=3)
    m, _ = build_tiny("micro", seed=1)
    capped = sft_warmstart(m, TOK, env, steps=4, batch_size=4, seed=0, target_accuracy=0.99, probe_tasks=16)
    # An untrained model is nowhere near 99%: it runs to the cap and says so.
    assert (capped["steps"], capped["reached"], capped["probe_accuracy"]) == (4, False, 0.0)
    assert capped["probe_curve"] == [[2, 0.0], [4, 0.0]]
    # A multi-turn env with an imperfect expert probes its clean episodes, every check_every steps.
    lookup = get_env("lookup", expert_guess_rate=0.3, expert_slip_rate=0.4)
    m, _ = build_tiny("micro", seed=1)
    multi = sft_warmstart(
        m, TOK, lookup, steps=6, batch_size=4, seed=0, target_accuracy=0.5, probe_tasks=32, check_every=3
    )
    assert (multi["steps"], multi["reached"], multi["probe_curve"]) == (6, False, [[3, 0.0], [6, 0.0]])
    # A sampled target adds the expected sampled success to every check and to the stop: an
    # untrained model replays no 10-odd-token episode by sampling.
    m, _ = build_tiny("micro", seed=1)
    heard: list[tuple[int, float, float]] = []
    both = sft_warmstart(
        m,
        TOK,
        lookup,
        steps=4,
        batch_size=4,
        seed=0,
        target_accuracy=0.5,
        sampled_target=0.2,
        probe_tasks=32,
        on_check=lambda *point: heard.append(point),
    )
    assert (both["steps"], both["reached"], [p[0] for p in both["probe_curve"]]) == (4, False, [2, 4])
    assert all(len(p) == 3 and 0.0 <= p[2] < 1e-3 for p in both["probe_curve"])
    assert round(both["probe_sampled"], 4) == both["probe_curve"][-1][2]
    # Every check is heard as it happens (a demo's progress line), unrounded.
    assert [[s, round(g, 4), round(p, 4)] for s, g, p in heard] == both["probe_curve"]
    heard.clear()
    m, _ = build_tiny("micro", seed=1)
    sft_warmstart(
        m,
        TOK,
        env,
        steps=4,
        batch_size=4,
        seed=0,
        target_accuracy=0.99,
        probe_tasks=16,
        on_check=lambda *p: heard.append(p),
    )
    assert heard == [(2, 0.0, -1.0), (4, 0.0, -1.0)]  # no sampled target: sampled is -1
    for bad in (
        {"target_accuracy": 1.5},
        {"target_accuracy": 0.5, "probe_tasks": 0},
        {"target_accuracy": 0.5, "sampled_target": 1.5},
        {"sampled_target": 0.2},
        {"target_accuracy": 0.5, "sampled_target": 0.2, "temperature": 0.0},
    ):
        with pytest.raises(ValueError, match=r"target_accuracy|probe_tasks|sampled_target|temperature"):
            sft_warmstart(m, TOK, env, steps=4, **bad)  # type: ignore[arg-type]


def test_model_source_builds_the_seeded_preset_and_sets_threads() -> None:
    assert set(PRESET_NAMES) == set(PRESETS)
    before = torch.get_num_threads()
    try:
        m, tok = load_model(ModelSource(preset="tiny", seed=5, threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    ref, _ = build_tiny("tiny", seed=5)
    assert isinstance(tok, ByteTokenizer) and not m.training
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in m.state_dict().items())
    with pytest.raises(msgspec.ValidationError, match="preset 'huge' is unknown"):
        msgspec.convert({"preset": "huge"}, ModelSource)


def test_rows_of_very_unlike_lengths_train_in_length_groups_to_the_same_mean_loss() -> None:
    import slipstream.supervised.warmstart as ws

    def row(n: int, start: int = 3) -> tuple[list[int], list[bool]]:
        ids = [(start + 7 * i) % 250 + 1 for i in range(n)]
        return ids, [False] * (n // 2) + [True] * (n - n // 2)

    # Rows of like length (or all short) stay one batch, in order: a plan's batches are unchanged.
    alike = [row(400), row(450), row(380)]
    assert ws._length_groups(alike) == [alike] and ws._by_length(alike) == [0, 1, 2]
    short = [row(60), row(900), row(30)]
    assert ws._length_groups(short) == [short]
    # A long row among short ones: groups of rows within twice their shortest, shortest first.
    mixed = [row(1500), row(60, 5), row(400, 9), row(70, 11), row(2000, 13)]
    assert [[len(r[0]) for r in g] for g in ws._length_groups(mixed)] == [[60, 70], [400], [1500, 2000]]
    assert ws._by_length(mixed) == [1, 3, 2, 0, 4]

    def step(groups_of: object) -> tuple[float, int, list[torch.Tensor]]:
        m, _ = build_tiny("micro", seed=4)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        original = ws._length_groups
        ws._length_groups = groups_of  # type: ignore[assignment]
        try:
            loss, trained = ws._train_step(m, opt, sched, mixed, TOK.pad_id, grad_clip=0.0)
        finally:
            ws._length_groups = original
        return loss, trained, [p.grad.clone() for p in m.parameters() if p.grad is not None]

    grouped = step(ws._length_groups)
    padded = step(lambda rows: [rows])  # the old way: everything padded to 2,000 tokens
    assert grouped[1] == padded[1] == sum(sum(t[1:]) for _, t in mixed)
    assert grouped[0] == pytest.approx(padded[0], rel=1e-5)
    for a, b in zip(grouped[2], padded[2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # The probes batch long rows by length too, and give each example its own figure back in order.
    m, _ = build_tiny("micro", seed=4)
    one_by_one = [ws._argmax_hits(m, [ex], TOK.pad_id, 1)[0] for ex in mixed]
    assert ws._argmax_hits(m, mixed, TOK.pad_id, 2) == one_by_one
    singles = [ws._sampled_logprobs(m, [ex], TOK.pad_id, 1.0, 1)[0] for ex in mixed]
    assert ws._sampled_logprobs(m, mixed, TOK.pad_id, 1.0, 2) == pytest.approx(singles, rel=1e-5)
