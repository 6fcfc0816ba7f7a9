"""The `search` environment's harness rules, played through the real episode harness.

Episodes run in libs/harness (`rollout_episodes`) with a `ScriptedEngine` (libs/supervised) replaying fixed model
lines (or the env's expert) and the byte tokenizer, so token counts are exact. The search backend
is tests/unit/search_backend.py's deterministic term-overlap backend ("terms"), a test stand-in
for libs/retrieval's hybrid backend: retrieval quality is not under test here, the harness is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import pytest
import search_backend  # noqa: F401  (registers the "terms" backend)

from slipstream.engine import ByteTokenizer, SamplingParams
from slipstream.envs import get_env, task_of
from slipstream.envs.base import TaskSpec
from slipstream.envs.context import Purpose
from slipstream.envs.search import Search
from slipstream.envs.search.expert import call
from slipstream.envs.search.reward import f_beta
from slipstream.harness import RecordingEngine, evaluate, rollout_episodes, token_problems
from slipstream.schemas import Episode
from slipstream.supervised import ScriptedEngine

pytestmark = pytest.mark.unit

TOK = ByteTokenizer()
USAGE = re.compile(r"\[Token usage: ([\d,]+)/([\d,]+)\]\n")


def env(**options: Any) -> Search:
    e = get_env("search", backend="terms", **options)
    assert isinstance(e, Search)
    return e


def task(e: Search, split: str = "train", hops: int = 2) -> TaskSpec:
    return next(t for t in e.generate(split, 40, seed=1) if t.metadata["hops"] == str(hops))  # type: ignore[arg-type]


async def play(
    e: Search, t: TaskSpec, lines: Sequence[str] | None = None, *, purpose: Purpose = "train", version: int = 0
) -> Episode:
    """One episode played for `purpose` by policy `version`; `lines` are the model's turns in order
    (None: the env's expert)."""
    script = iter(lines or [])

    def reply(_req: Any, context: str) -> str:
        return next(script, "<docs></docs>\n") if lines is not None else e.expert(t, context)

    engine = RecordingEngine(ScriptedEngine(TOK, reply, max_seq_len=1 << 16, policy_version=version))
    params = SamplingParams(temperature=1.0, max_tokens=4096)
    (episode,) = await rollout_episodes(
        engine, TOK, e, t, group_size=1, params=params, group_id=f"g-{t.task_id}", purpose=purpose
    )
    # Every episode here is also checked against the engine calls that made it (ids, masks, edits).
    assert token_problems(episode, engine.calls_of(episode), TOK) == []
    return episode


def observations(ep: Episode) -> list[str]:
    return [turn.text for s in ep.samples for turn in s.turns if turn.role == "observation"]


def search(q: str) -> str:
    return call("search_corpus", query=q) + "\n"


async def test_usage_line_after_every_turn_is_exact_and_counts_the_context() -> None:
    e = env()
    t = task(e)
    q = t.metadata["queries"].split("|")
    ep = await play(e, t, [search(q[0]), search(q[1]), "<docs>x</docs>\n"])
    lines = [o for o in observations(ep) if o.startswith("[Token usage")]
    assert len(lines) == 2
    root = ep.samples[0]
    for turn in (x for x in root.turns if x.text.startswith("[Token usage")):
        # X is the sample's length after the turn's results were appended, just before this line.
        assert turn.text.startswith(f"[Token usage: {turn.start:,}/2,048]\n")
    assert USAGE.fullmatch(lines[0]) is not None
    big = env(budget_tokens=32_768, search_tokens=4096, reserve_tokens=512)
    ep = await play(big, task(big), [search("town"), "<docs>x</docs>\n"])
    (line,) = [o for o in observations(ep) if o.startswith("[Token usage")]
    used = int(USAGE.match(line).group(1).replace(",", ""))  # type: ignore[union-attr]
    assert used > 1000 and line.startswith(f"[Token usage: {used:,}/32,768]\n") and "," in line.split("/")[0]


async def test_soft_message_past_half_budget_on_training_rollouts_only_not_by_split() -> None:
    e = env(budget_tokens=1024, search_tokens=600, reserve_tokens=160, hard_cutoff=1.0)
    lines = [search("town company patent thread"), search("it is a in the"), "<docs>x</docs>\n"]
    soft = "[Over half the budget"
    t = task(e, "train")
    rollout = await play(e, t, lines)  # the rollout worker's purpose
    train_obs = observations(rollout)
    assert any(soft in o for o in train_obs) and rollout.counts.get("soft_messages", 0) >= 1
    # The same train-split task played as an evaluation: past half the budget alike, no message.
    as_eval = await play(e, t, lines, purpose="eval")
    usage = [o for o in observations(as_eval) if o.startswith("[Token usage")]
    assert usage[0] == next(o for o in train_obs if o.startswith("[Token usage")).split("]")[0] + "]\n"
    assert int(USAGE.match(usage[0]).group(1).replace(",", "")) > 512  # type: ignore[union-attr]
    assert not any(soft in o for o in observations(as_eval)) and "soft_messages" not in as_eval.counts
    # A held-out task in a training rollout sees it: the purpose decides, not the split.
    assert any(soft in o for o in observations(await play(e, task(e, "heldout"), lines)))
    # Through the evaluation loop itself (eval-gate's and the demo's held-out figures), a train-split
    # task's contexts never hold it, though they pass half the budget.
    contexts: list[str] = []
    script = iter(lines)

    def reply(_req: Any, context: str) -> str:
        contexts.append(context)
        return next(script, "<docs></docs>\n")

    engine = ScriptedEngine(TOK, reply, max_seq_len=1 << 16)
    report = await evaluate(engine, TOK, e, [t], params=SamplingParams(temperature=0.0, max_tokens=4096))
    assert report.n == 1 and len(contexts) == 3
    used = [int(u.replace(",", "")) for u in re.findall(r"\[Token usage: ([\d,]+)/", contexts[-1])]
    assert max(used) > 512 and not any(soft in c for c in contexts)
    # Below half the budget there is no message, even in training.
    first = next(o for o in train_obs if o.startswith("[Token usage"))
    used_first = int(USAGE.match(first).group(1).replace(",", ""))  # type: ignore[union-attr]
    assert (soft in first) == (used_first > 512)
    always = env(budget_tokens=1024, search_tokens=600, reserve_tokens=160, hard_cutoff=1.0, soft_message="always")
    assert any(soft in o for o in observations(await play(always, t, lines, purpose="eval")))


async def test_the_beta_schedule_reaches_the_reward() -> None:
    """F_beta's beta follows the policy version that sampled the episode, as the reward-model scores it."""
    from slipstream.reward_model.scorer import Scorer

    options = {"backend": "terms", "beta_anneal_versions": 100}
    e = env(beta_anneal_versions=100)
    t = task(e, hops=2)
    targets = t.metadata["targets"].split()
    output = [targets[0], "x001", "x002"]  # P = 1/3, R = 1/2: F_beta moves with beta
    line = f"<docs>{' '.join(output)}</docs>\n"
    scheduled, fixed = Scorer({"search": options}), Scorer({"search": {"backend": "terms"}})
    betas = {0: 4.0, 25: 3.5, 50: 3.0, 100: 2.0, 150: 2.0}
    for version, beta in betas.items():
        episode = await play(e, t, [line], version=version)
        assert episode.oldest_version() == version
        scored, score = scheduled.score(episode, now=0.0)
        assert f"beta={beta:g}" in score.reason, (version, score.reason)
        assert scored.components["f_beta"] == pytest.approx(0.7 * f_beta(output, set(targets), beta))
        unscheduled, _ = fixed.score(episode, now=0.0)
        assert unscheduled.components["f_beta"] == pytest.approx(0.7 * f_beta(output, set(targets), 4.0))
    # Annealed, recall weighs less: this high-recall, low-precision output earns more at beta 4 than at 2.
    early = scheduled.score(await play(e, t, [line], version=0), now=0.0)[0]
    late = scheduled.score(await play(e, t, [line], version=100), now=0.0)[0]
    assert early.reward > late.reward


async def test_past_the_hard_cutoff_every_tool_but_prune_is_refused() -> None:
    e = env(budget_tokens=2048, search_tokens=1400, reserve_tokens=400, hard_cutoff=0.5)
    backend = e.backend()
    t = task(e)
    ep = await play(e, t, [search("town company patent thread it")])  # fills past 50 %
    (first,) = [o for o in observations(ep) if o.startswith("<result>")]
    chunk = re.search(r'<chunk id="([^"]+)">', first).group(1)  # type: ignore[union-attr]
    n_backend = len(backend.calls)  # type: ignore[attr-defined]
    turn = (
        search("heron")
        + call("grep_corpus", pattern="heron")
        + call("read_document", doc_id="w0001")
        + call("prune_chunks", chunk_ids=[chunk])
    )
    ep = await play(e, t, [search("town company patent thread it"), turn, "<docs>x</docs>\n"])
    events = ep.tool_log
    refused = [ev for ev in events if ev.info.get("kind") == "budget_refused"]
    assert [ev.name for ev in refused] == ["search_corpus", "grep_corpus", "read_document"]
    assert all("prune" in ev.error and "final answer" in ev.error for ev in refused)
    assert all(ev.status == "invalid_tool_call" and ev.info["refused"] == "hard_cutoff" for ev in refused)
    assert events[-1].name == "prune_chunks" and events[-1].status == "ok"
    assert ep.counts["budget_refusals"] == 3
    # The refused calls never reached the backend: only the two first searches did.
    assert len(backend.calls) == 2 * n_backend  # type: ignore[attr-defined]


async def test_seen_chunks_are_excluded_by_a_hidden_argument() -> None:
    e = env()
    backend = e.backend()
    t = task(e)
    ep = await play(
        e,
        t,
        [search("town heron"), search("town heron"), call("grep_corpus", pattern="town") + "\n", "<docs>x</docs>\n"],
    )
    calls = backend.calls  # type: ignore[attr-defined]
    first, second, grep = calls[-3:]
    returned = ep.tool_log[0].info["chunks"].split(",")
    assert first[1]["exclude"] == [] and sorted(second[1]["exclude"]) == sorted(returned)
    again = ep.tool_log[1].info["chunks"].split(",")
    assert not set(again) & set(returned)
    assert set(grep[1]["exclude"]) == set(returned) | set(again)
    # The model never sees the hidden arguments: not in its schemas, not in the logged call text.
    assert "exclude" not in json.dumps(e.model_registry.specs()) and "budget_tokens" not in json.dumps(
        e.model_registry.specs()
    )
    assert all("exclude" not in ev.arguments for ev in ep.tool_log)
    assert all(set(tool.hidden) >= {"_exclude", "_budget"} for tool in e.registry)


async def test_the_reserve_is_kept_for_the_next_response() -> None:
    """Results are cut so that, after them and the usage line, `reserve_tokens` are still free; a
    call that cannot fit anything is refused (no room) rather than eat into the reserve."""
    e = env(budget_tokens=1024, search_tokens=1024, reserve_tokens=200, hard_cutoff=1.0)
    lines = [search("town company patent thread it is a"), search("the of in its"), "<docs>x</docs>\n"]
    ep = await play(e, task(e), lines)
    turns = ep.samples[-1].turns
    first_result, first_status = turns[1], turns[2]
    assert first_result.text.startswith("<result><chunk") and first_status.text.startswith("[Token usage")
    assert 1024 - first_status.end >= 200, f"only {1024 - first_status.end} tokens left"
    # The backend was asked for what fits, not for search_tokens, and the harness cut the rest.
    (asked,) = e.backend().calls  # type: ignore[attr-defined]
    assert asked[1]["budget_tokens"] <= 1024 - 200 - first_result.start
    # The second search had no room left (under the reserve): refused, never sent to the backend.
    second = ep.tool_log[1]
    assert second.info["kind"] == "budget_refused" and second.info["refused"] == "no_room"
    assert ep.counts["budget_refusals"] == 1
    # The next response may use the reserve: its max_tokens is what is left, at most the reserve.
    assert all(t.end - t.start <= 200 for t in turns if t.role == "policy")


async def test_prune_is_a_new_sample_and_the_full_log_is_kept() -> None:
    e = env()
    t = task(e, hops=1)
    ep = await play(e, t, [search("town heron fox"), "PLACEHOLDER"])
    first = ep.tool_log[0].info["chunks"].split(",")
    keep, drop = first[0], first[1:]
    lines = [
        search("town heron fox"),
        call("prune_chunks", chunk_ids=drop) + "\n",
        f"<docs>{keep.split('#')[0]}</docs>\n",
    ]
    ep = await play(e, t, lines)
    assert len(ep.samples) == 2
    parent, child = ep.samples
    assert child.branch_of == parent.sample_id and child.edit == "prune" and parent.finish_reason == "edit"
    view = TOK.decode(child.ids())
    for cid in drop:
        assert f"[pruned: {cid}]" in view and f'<chunk id="{cid}">' not in view
        assert f'<chunk id="{cid}">' in TOK.decode(parent.ids())
    assert f'<chunk id="{keep}">' in view
    # The log is the unpruned record: the search result is there in full, marked hidden only if all its chunks went.
    assert all(f'<chunk id="{cid}">' in ep.tool_log[0].result for cid in first)
    assert ep.tool_log[0].hidden is False
    # The usage line after the prune shows the smaller context.
    usages = [int(m.group(1).replace(",", "")) for m in USAGE.finditer(TOK.decode(child.ids()))]
    assert usages[-1] < len(parent.ids())
    # Trajectory recall reads the full log: pruned documents count as seen.
    score = e.score(task_of(ep), ep)
    assert score.parse_ok


async def test_a_second_prune_rewrites_the_first_prunes_view() -> None:
    e = env(budget_tokens=4096, search_tokens=300, reserve_tokens=400)
    t = task(e, hops=1)
    probe = await play(e, t, [search("town heron fox"), search("patent owl hawk"), "<docs>x</docs>\n"])
    a, b = (ev.info["chunks"].split(",") for ev in probe.tool_log)
    lines = [
        search("town heron fox"),
        search("patent owl hawk"),
        call("prune_chunks", chunk_ids=[a[0]]) + "\n",
        call("prune_chunks", chunk_ids=[b[0], a[1]]) + "\n",
        "<docs>x</docs>\n",
    ]
    ep = await play(e, t, lines)
    root, first, second = ep.samples
    assert (first.branch_of, second.branch_of) == (root.sample_id, first.sample_id)
    view = TOK.decode(second.ids())
    for cid in (a[0], a[1], b[0]):
        assert f"[pruned: {cid}]" in view and f'<chunk id="{cid}">' not in view
    assert all(f'<chunk id="{cid}">' in view for cid in [*a[2:], *b[1:]])
    # Both prompts keep the task prompt verbatim; the policy's calls are all still in view.
    assert view.count("<tool>") == 4 and view.startswith(TOK.decode(root.ids())[: len(t.prompt)])
    assert [ev.name for ev in ep.tool_log] == ["search_corpus", "search_corpus", "prune_chunks", "prune_chunks"]


async def test_pruning_a_target_still_counts_it_for_trajectory_recall() -> None:
    e = env()
    t = task(e, hops=1)
    target = t.metadata["targets"]
    ep = await play(e, t, [call("read_document", doc_id=target) + "\n", "PLACEHOLDER"])
    chunk = ep.tool_log[0].info["chunks"].split(",")
    ep = await play(
        e,
        t,
        [
            call("read_document", doc_id=target) + "\n",
            call("prune_chunks", chunk_ids=chunk) + "\n",
            "<docs>f9999</docs>\n",
        ],
    )
    assert ep.tool_log[0].hidden is True
    s = e.score(task_of(ep), ep)
    assert s.components["traj_recall"] == pytest.approx(0.3) and s.components["f_beta"] == 0.0
    assert not s.correct and s.reward == pytest.approx(0.3)


async def test_the_expert_finds_the_documents_and_prunes_near_the_threshold() -> None:
    e = env()
    found = 0
    prunes = 0
    tasks = e.generate("train", 12, seed=3)
    for t in tasks:
        ep = await play(e, t)
        s = e.score(task_of(ep), ep)
        found += s.correct
        prunes += ep.counts.get("edit_prune", 0)
        assert s.parse_ok and ep.final_text.startswith("<docs>")
    assert found == len(tasks) and prunes > 0


async def test_final_output_is_a_ranked_doc_list_and_malformed_output_scores_zero() -> None:
    e = env()
    t = task(e, hops=2)
    targets = t.metadata["targets"].split()
    ep = await play(e, t, ["I think it is Marmar\n"])
    s = e.score(task_of(ep), ep)
    assert not s.parse_ok and s.reward == 0.0
    s = e.score(t, f"<docs>{targets[1]}, {targets[0]} {targets[1]}#0</docs>\n")
    assert s.correct and s.components["f_beta"] == pytest.approx(0.7)


def test_the_env_calls_the_tool_service_search_set_with_the_same_arguments() -> None:
    """In-process and over NATS a turn's calls are the same: the env's backend tools and the
    tool-service's `search` tool set (libs/retrieval) take the same names and arguments, hidden
    ones included, so `[tools] transport = "nats"` needs no translation."""
    from slipstream.retrieval.tools import search_tools

    service = {t.name: t for t in search_tools(None)}  # the wire schemas, no implementation
    env_side = {t.name: t for t in env().registry}
    assert set(service) == set(env_side) == {"search_corpus", "grep_corpus", "read_document"}
    for name, tool in env_side.items():
        assert set(tool.parameters["properties"]) == set(service[name].parameters["properties"]), name
        assert tool.hidden == service[name].hidden, name
        assert not any(k.startswith("_") for k in tool.spec()["function"]["parameters"]["properties"]), name


def test_bad_options_are_named() -> None:
    with pytest.raises(Exception, match="hard_cutoff"):
        get_env("search", hard_cutoff=0.3)
    with pytest.raises(Exception, match="reserve_tokens"):
        get_env("search", reserve_tokens=4)
    with pytest.raises(LookupError, match="no search backend named 'nope'"):
        get_env("search", backend="nope").backend()  # type: ignore[attr-defined]
    with pytest.raises(LookupError, match="cannot be imported"):
        get_env("search", backend="no_such_module:Factory").backend()  # type: ignore[attr-defined]


async def test_a_missing_backend_fails_the_episode_loudly() -> None:
    e = get_env("search", backend="not-registered")
    with pytest.raises(LookupError, match="no search backend named 'not-registered'"):
        await play(e, e.generate("train", 1, seed=0)[0], ["<docs>x</docs>\n"])  # type: ignore[arg-type]


def test_a_backend_can_be_named_by_import_path() -> None:
    e = get_env("search", backend="search_backend:TermBackend")
    assert type(e.backend()).__name__ == "TermBackend"  # type: ignore[attr-defined]


def test_splits_are_by_domain_and_the_curriculum_shifts_the_hop_mix() -> None:
    e = env()
    train, held = e.generate("train", 300, seed=2), e.generate("heldout", 100, seed=2)
    assert {t.metadata["domain"] for t in train} == {"web", "legal", "finance"}
    assert {t.metadata["domain"] for t in held} == {"email"} and all(t.split == "heldout" for t in held)
    assert e.generate("train", 300, seed=2) == train and e.generate("train", 10, seed=2) == train[:10]
    assert [t.prompt for t in e.generate("train", 20, seed=3)] != [t.prompt for t in train[:20]]

    def mean_hops(phase: int) -> float:
        tasks = env(curriculum_phase=phase).generate("train", 400, seed=1)
        return sum(int(t.metadata["hops"]) for t in tasks) / len(tasks)

    # Phase 1 weights hops 1..3 as 4:2:1 (mean 11/7), phase 2 as 1:2:4 (mean 17/7).
    assert mean_hops(1) == pytest.approx(11 / 7, abs=0.12) and mean_hops(2) == pytest.approx(17 / 7, abs=0.12)
    other = env(heldout_domain="web")
    assert {t.metadata["domain"] for t in other.generate("heldout", 50, seed=0)} == {"web"}


async def test_a_soft_message_share_shows_it_to_that_share_of_training_tasks_and_never_to_evaluations() -> None:
    """`soft_message_share` < 1: a model copying its teacher also sees the context evaluations play
    (the micro model warm-started on messages only answered badly without one: session 30)."""
    base = dict(budget_tokens=1024, search_tokens=600, reserve_tokens=160, hard_cutoff=1.0)
    lines = [search("town company patent thread"), search("it is a in the"), "<docs>x</docs>\n"]
    soft = "[Over half the budget"
    half = env(**base, soft_message_share=0.5)
    tasks = half.generate("train", 40, seed=3)
    shown = [half.training("train", t.task_id) for t in tasks]
    assert 10 <= sum(shown) <= 30  # a draw per task, about half
    assert shown == [half.training("train", t.task_id) for t in tasks]  # fixed: a group's samples alike
    assert not any(half.training("eval", t.task_id) for t in tasks)
    on = next(t for t, s in zip(tasks, shown, strict=True) if s)
    off = next(t for t, s in zip(tasks, shown, strict=True) if not s)
    assert any(soft in o for o in observations(await play(half, on, lines)))
    played_off = await play(half, off, lines)
    assert not any(soft in o for o in observations(played_off)) and "soft_messages" not in played_off.counts
    assert not any(soft in o for o in observations(await play(half, on, lines, purpose="eval")))
    every = env(**base)  # the default share, 1: every training episode
    assert all(every.training("train", t.task_id) for t in tasks)
    with pytest.raises(ValueError, match=r"soft_message_share must be in \[0, 1\], got 1.5"):
        env(soft_message_share=1.5)
