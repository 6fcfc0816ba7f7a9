"""The episode-level harness: an environment's own loop (generate, observe, branch, spawn, log tools)
recorded as an `Episode`, the reset/step adapter, scoring of whole episodes, and the provenance
check that proves ids were made once (and catches a sample that was rebuilt or rewritten)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, ClassVar

import msgspec
import pytest

from slipstream.engine import ByteTokenizer, CausalLM, SamplingParams, TorchEngine, build_tiny
from slipstream.envs import (
    ContextFull,
    EpisodeContext,
    Outcome,
    Score,
    Span,
    TaskSpec,
    get_env,
    play_rewards,
    task_of,
)
from slipstream.envs.base import Environment, Problem
from slipstream.harness import RecordingEngine, rollout_episodes, rollout_group, token_problems
from slipstream.schemas import Episode, Sample, ToolEvent, decode, encode, pack_ids, pack_mask

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def model() -> CausalLM:
    m, _ = build_tiny("tiny", seed=11)
    return m.eval()


@pytest.fixture
async def engine(model: CausalLM) -> AsyncIterator[RecordingEngine]:
    eng = RecordingEngine(TorchEngine(model, TOK, max_batch=8, max_seq_len=160, device="cpu"))
    await eng.start()
    yield eng
    await eng.stop()


class _Agentic(Environment[msgspec.Struct]):
    """Plays every feature once: a tool call logged, a summary restart (branch), a frozen sub-agent."""

    name: ClassVar[str] = "t-agentic"

    class Options(msgspec.Struct, frozen=True):
        pass

    components: ClassVar[tuple[str, ...]] = ("correct",)

    def sample(self, rng: Any) -> Problem:
        word = "".join(rng.choice("abc") for _ in range(3))
        return Problem(key=word, prompt=f"go {word}:", reference=word)

    def grade(self, task: TaskSpec, completion: str) -> Score:
        return Score.of({"correct": float(completion == task.reference)}, correct=False, parse_ok=True, reason="")

    async def run(self, ctx: EpisodeContext) -> Outcome:
        root = ctx.open(ctx.task.prompt)
        first = await ctx.generate(root, max_tokens=5)
        ctx.log_tool(ToolEvent(sample_id=root.sample_id, turn=first.turn, name="echo", arguments="{}", result="x"))
        ctx.observe(root, "<result>x</result>")
        summary = await ctx.generate(root, max_tokens=4)
        assert summary.n_tokens > 0
        # Summary restart: the prompt, then the summary's own sampled ids (copied, never re-encoded).
        role, start, end, _ = root.spans()[-1]
        assert role == "policy"
        prompt_len = root.spans()[0][1]
        child = ctx.branch(root, [Span(0, prompt_len), "summary:", Span(start, end)], edit="summary")
        sub_task = get_env("arith").generate("train", 1, seed=1)[0]
        sub = await ctx.spawn(get_env("arith"), sub_task, agent_id="helper")
        ctx.observe(child, f"[helper said {sub.final_text!r}]")
        ctx.reward("swarm_bonus", 0.25)
        ctx.count("custom", 2)
        last = await ctx.generate(child, max_tokens=3)
        return Outcome(final_text=child.completion_text(), finish_reason=last.finish_reason)


async def test_agentic_episode_records_samples_branches_subagents_and_tool_log(engine: RecordingEngine) -> None:
    env = _Agentic()
    task = env.generate("train", 1, seed=0)[0]
    params = SamplingParams(temperature=1.0, max_tokens=8)
    episodes = await rollout_episodes(engine, TOK, env, task, group_size=2, params=params, group_id="g", run_id="r")
    assert [e.episode_id for e in episodes] == ["g/0", "g/1"]
    for e in episodes:
        assert token_problems(e, engine.calls_of(e), TOK) == []
        root, child, sub = e.samples
        assert (root.sample_id, child.sample_id, sub.sample_id) == (
            e.episode_id,
            f"{e.episode_id}/s1",
            f"{e.episode_id}/s2",
        )
        # Root: prompt, 2 sampled turns around one observation; closed by the edit.
        assert [t.role for t in root.turns] == ["policy", "observation", "policy"]
        assert root.finish_reason == "edit" and root.trainable and root.branch_of == ""
        # The branch keeps the prompt verbatim and names where it left the parent.
        assert (child.branch_of, child.edit) == (root.sample_id, "summary")
        assert child.branch_pos == root.prompt_len
        assert child.ids()[: root.prompt_len] == root.ids()[: root.prompt_len]
        summary = root.turns[-1]
        assert (
            child.ids()[child.prompt_len - (summary.end - summary.start) : child.prompt_len]
            == root.ids()[summary.start : summary.end]
        )
        # The sub-agent is frozen, tagged, and its tokens are its own sample.
        assert (sub.agent_id, sub.role, sub.trainable) == ("helper", "subagent", False)
        assert sub.n_sampled() > 0 and sub.branch_of == ""
        assert e.counts["subagents"] == 1 and e.counts["edit_summary"] == 1 and e.counts["custom"] == 2
        assert e.counts["turns"] == 4 and e.counts["tool_calls"] == 1 and e.counts["samples"] == 3
        assert [t.name for t in e.tool_log] == ["echo"]
        assert play_rewards(e) == {"swarm_bonus": 0.25}
        assert e.final_text == TOK.decode([t for t in child.ids()[child.prompt_len :] if t != TOK.EOS])
        assert decode(encode(e), Episode) == e
    score = env.score(task_of(episodes[0]), episodes[0])
    assert set(score.components) == {"correct", "swarm_bonus"}
    assert score.reward == pytest.approx(score.components["correct"] + 0.25)


async def test_the_adapter_gives_one_sample_episodes_equal_to_v1_trajectories(engine: RecordingEngine) -> None:
    env = get_env("arith")
    task = env.generate("train", 1, seed=4)[0]
    params = SamplingParams(temperature=1.0, max_tokens=6)
    eps = await rollout_episodes(engine, TOK, env, task, group_size=3, params=params, group_id="same")
    trajs = await rollout_group(engine, TOK, env, task, group_size=3, params=params, group_id="same")
    for e, t in zip(eps, trajs, strict=True):
        (s,) = e.samples
        assert (t.trajectory_id, t.token_ids, t.loss_mask, t.completion_text) == (
            e.episode_id,
            s.token_ids,
            s.loss_mask,
            e.final_text,
        )
        assert e.counts == {"turns": 1, "samples": 1}
        assert env.score(task, e) == env.score(task, t.completion_text)
        assert token_problems(e, engine.calls_of(e), TOK) == []


async def test_provenance_check_catches_rebuilt_rewritten_and_mislabelled_tokens(engine: RecordingEngine) -> None:
    env = _Agentic()
    task = env.generate("train", 1, seed=2)[0]
    (e,) = await rollout_episodes(engine, TOK, env, task, group_size=1, params=SamplingParams(max_tokens=8))
    calls = engine.calls_of(e)
    root = e.samples[0]

    def with_root(**changes: Any) -> Episode:
        return msgspec.structs.replace(e, samples=[msgspec.structs.replace(root, **changes), *e.samples[1:]])

    # A sampled token changed (what re-encoding decoded text does to a non-bijective tokenizer).
    ids = root.ids()
    first_sampled = root.prompt_len
    ids[first_sampled] = (ids[first_sampled] + 1) % 256
    assert any("differ from engine call" in p for p in token_problems(with_root(token_ids=pack_ids(ids)), calls, TOK))
    # An observation token marked as trained.
    mask = root.mask()
    mask[mask.index(0)] = 1
    assert any("loss mask" in p for p in token_problems(with_root(loss_mask=pack_mask(mask)), calls, TOK))
    # A branch that claims more shared prefix than it has.
    child = msgspec.structs.replace(e.samples[1], branch_pos=e.samples[1].branch_pos + 1)
    bad = msgspec.structs.replace(e, samples=[root, child, *e.samples[2:]])
    assert any("branch_pos" in p for p in token_problems(bad, calls, TOK))
    # A call whose sample went missing.
    assert any(
        "extended no sample" in p for p in token_problems(msgspec.structs.replace(e, samples=[root]), calls, TOK)
    )
    # Stray tokens: an observation turn's record removed, so its tokens have no origin.
    turns = [t for t in root.turns if t.role == "policy"]
    assert any("neither the engine" in p for p in token_problems(with_root(turns=turns), calls, TOK))


class _Chatty(_Agentic):
    name: ClassVar[str] = "t-chatty"

    async def run(self, ctx: EpisodeContext) -> Outcome:
        thread = ctx.open(ctx.task.prompt)
        while True:
            await ctx.generate(thread, max_tokens=8)
            ctx.observe(thread, "more " * 10)


async def test_a_sample_outgrowing_the_context_ends_the_episode_with_length(engine: RecordingEngine) -> None:
    env = _Chatty()
    task = env.generate("train", 1, seed=0)[0]
    (e,) = await rollout_episodes(engine, TOK, env, task, params=SamplingParams(max_tokens=8, ignore_eos=True))
    (s,) = e.samples
    assert e.finish_reason == "length" and s.finish_reason == "length"
    assert len(s.ids()) < 160
    assert token_problems(e, engine.calls_of(e), TOK) == []


async def test_closed_samples_cannot_be_appended_to() -> None:
    m, _ = build_tiny("tiny", seed=1)
    eng = TorchEngine(m.eval(), TOK, max_batch=2, max_seq_len=64, device="cpu")

    class _Rewrites(_Agentic):
        name: ClassVar[str] = "t-rewrites"

        async def run(self, ctx: EpisodeContext) -> Outcome:
            root = ctx.open("x")
            ctx.branch(root, [Span(0, 1), "y"], edit="prune")
            ctx.observe(root, "z")  # must fail: the parent is never rewritten after an edit
            return Outcome()

    env = _Rewrites()
    with pytest.raises(ValueError, match="is closed"):
        await rollout_episodes(eng, TOK, env, env.generate("train", 1, seed=0)[0], params=SamplingParams())


def test_score_of_a_stub_episode_is_a_failure_naming_it() -> None:
    env = get_env("arith")
    task = env.generate("train", 1, seed=0)[0]
    from slipstream.schemas import EpisodeRef

    stub = Episode(episode_id="e1", task_id=task.task_id, env="arith", body_ref=EpisodeRef(key="k", size=1, sha256="0"))
    s = env.score(task, stub)
    assert (s.reward, s.parse_ok) == (0.0, False) and "stub" in s.reason
    ok = Episode(
        episode_id="e2",
        task_id=task.task_id,
        env="arith",
        samples=[Sample(sample_id="e2")],
        final_text=task.reference + "\n",
    )
    assert env.score(task, ok).correct


def test_context_full_names_the_sample_and_sizes() -> None:
    exc = ContextFull("e/s1", 300, 256)
    assert "e/s1" in str(exc) and "300" in str(exc) and "256" in str(exc)
