"""The BM25-only search backend (`bm25`), the grep-first expert and the env's figures in `evaluate`.

The demo plan of `slipstream demo --env search` runs on these: LexicalSearch over the generated
corpus, an expert that finds the hop with grep_corpus on the clues, and the held-out figures
(Context-1's table) that the demo summary prints."""

from __future__ import annotations

import asyncio
import re

import pytest

from slipstream.engine.tokenizer import ByteTokenizer
from slipstream.envs import get_env
from slipstream.envs.search.expert import grep_pattern
from slipstream.harness.evaluate import evaluate
from slipstream.retrieval.lexical_backend import LexicalSearch
from slipstream.retrieval.types import Document
from slipstream.supervised.scripted import ScriptedEngine
from slipstream.supervised.warmstart import expert_episodes

pytestmark = pytest.mark.unit

DOCS = [
    Document(doc_id="a1", title="Orvel", text="Orvel is a town in the north. It dates from 1873."),
    Document(doc_id="a2", title="Belkel", text="Belkel is a town in the coast. It dates from 1871."),
    Document(doc_id="a3", title="Zanos", text="Zanos is a patent filed in the north. It dates from 1702."),
]
SMALL = {"max_hops": 1, "tasks_per_domain": 6, "distractors": 1, "filler_per_domain": 0, "tools_line": False}


def _bytes(text: str) -> int:
    return len(text.encode())


def test_bm25_search_ranks_masks_and_cuts_to_the_budget() -> None:
    b = LexicalSearch(DOCS, _bytes)
    got = asyncio.run(b.search("north town", exclude=set(), budget_tokens=10_000))
    assert [c.doc_id for c in got][:1] == ["a1"]  # both terms; a3 has one, a2 one
    assert {c.doc_id for c in got} == {"a1", "a2", "a3"}
    assert all(c.score > 0 for c in got)
    # Seen chunks never come back; a chunk with no query term is not a hit.
    again = asyncio.run(b.search("north town", exclude={"a1#0"}, budget_tokens=10_000))
    assert "a1" not in {c.doc_id for c in again}
    assert asyncio.run(b.search("river", exclude=set(), budget_tokens=10_000)) == []
    # Whole chunks up to the budget: one chunk's bytes fit, two do not.
    one = asyncio.run(b.search("north town", exclude=set(), budget_tokens=got[0].tokens))
    assert [c.chunk_id for c in one] == [got[0].chunk_id]


def test_bm25_grep_and_read_follow_the_backend_contract() -> None:
    b = LexicalSearch(DOCS, _bytes)
    hits = asyncio.run(b.grep("north. It dates from 187", exclude=set()))
    assert [c.doc_id for c in hits] == ["a1"]
    assert asyncio.run(b.grep("dates from", exclude={"a2#0"}, limit=1))[0].doc_id == "a1"
    with pytest.raises(ValueError, match="bad regular expression"):
        asyncio.run(b.grep("(", exclude=set()))
    read = asyncio.run(b.read("a2", query="coast", exclude=set(), budget_tokens=10_000))
    assert [c.chunk_id for c in read] == ["a2#0"]
    assert asyncio.run(b.read("a2", query=None, exclude={"a2#0"}, budget_tokens=10_000)) == []
    with pytest.raises(KeyError, match="no document"):
        asyncio.run(b.read("zz", query=None, exclude=set(), budget_tokens=10))


def test_grep_pattern_from_the_planned_query_and_its_slip() -> None:
    assert grep_pattern("town north 1870s") == "north. It dates from 187"
    assert grep_pattern("town north 1870s", slip=True) == "north. It dates from 188"
    assert grep_pattern("thread valley 1990s", slip=True) == "valley. It dates from 198"
    # The fixed_offsets corpus opens documents with the year: the decade's digits come first.
    assert grep_pattern("town north 1870s", fixed=True) == "from 187.*north"
    assert grep_pattern("town north 1870s", slip=True, fixed=True) == "from 188.*north"


def test_fixed_offsets_put_each_copy_a_fixed_distance_before_it_is_made() -> None:
    options = {**SMALL, "tasks_per_domain": 40, "distractors": 0, "min_year": 1000, "regions": 12}
    env = get_env(
        "search",
        backend="bm25",
        expert_grep=True,
        expert_slip_rate=0.3,
        unique_clues=True,
        short_ids=True,
        fixed_offsets=True,
        **options,
    )
    tasks = env.generate("train", 24, 3) + env.generate("heldout", 8, 3)
    eps = asyncio.run(expert_episodes(env, ByteTokenizer(), tasks))
    metrics = env.eval_metrics(tasks, eps)
    assert metrics["final_answer_found"] == 1.0 and metrics["precision"] == 1.0
    # The decade ends the question and opens the grep: "...dates from the 1870s?\n<tool>...from 187".
    call_gap = '0s?\n<tool>{"name": "grep_corpus", "args": {"pattern": "from '
    # The id ends the document and so the result, right before the usage line and the output.
    out_gap = re.compile(r"Id (\d{3})\.</chunk></result>\n\[Token usage: \d{3}/2,048\]\n<docs>(\d{3})</docs>")
    slipped = 0
    for t, e in zip(tasks, eps, strict=True):
        text = ByteTokenizer().decode(e.samples[-1].ids())
        decade = re.search(r"dates from the (\d{3})0s\?\n$", t.prompt)
        assert decade is not None and t.prompt.index("lies in") < decade.start()
        assert text.startswith(t.prompt + '<tool>{"name": "grep_corpus", "args": {"pattern": "from ')
        assert call_gap in text
        first = text[len(t.prompt) :].split('"pattern": "from ')[1][:3]
        slipped += first != decade.group(1)
        m = out_gap.search(text)
        assert m is not None and m.group(1) == m.group(2) == t.metadata["targets"]
    assert 0 < slipped < len(tasks)
    # Same seed, same corpus; every document opens with its year and ends with its id.
    again = get_env("search", backend="bm25", unique_clues=True, short_ids=True, fixed_offsets=True, **options)
    assert again.corpus == env.corpus
    for d in env.corpus.documents:
        assert re.fullmatch(r"[A-Z][a-z]+ dates from \d{4}\. It is an? .*\. Id " + d.doc_id + r"\.", d.text), d.text


def test_the_grep_expert_finds_every_train_target_through_bm25_and_slips_as_asked() -> None:
    env = get_env("search", backend="bm25", expert_grep=True, expert_slip_rate=0.5, **SMALL)
    assert env.generate("train", 1, 0)[0].prompt.count("\n") == 1  # the question only
    tasks = env.generate("train", 12, 3)
    eps = asyncio.run(expert_episodes(env, ByteTokenizer(), tasks))
    metrics = env.eval_metrics(tasks, eps)
    assert metrics["traj_recall"] == 1.0 and metrics["final_answer_found"] == 1.0
    first = [e.tool_log[0].name for e in eps]
    assert set(first) == {"grep_corpus"}
    slips = sum(len([ev for ev in e.tool_log if ev.name == "grep_corpus"]) > 1 for e in eps)
    assert 0 < slips < len(eps)


def test_evaluate_reports_the_env_figures() -> None:
    env = get_env("search", backend="bm25", expert_grep=True, **SMALL)
    tok = ByteTokenizer()
    tasks = env.generate("heldout", 4, 0)

    def reply(_request: object, context: str) -> str:
        task = next(t for t in tasks if context.startswith(t.prompt) or t.prompt in context)
        return env.expert(task, context)

    report = asyncio.run(evaluate(ScriptedEngine(tok, reply), tok, env, tasks, concurrency=1))
    m = report.metrics
    assert m["episodes"] == 4.0
    assert m["final_answer_found"] == report.accuracy
    assert {"output_recall", "traj_recall", "f1", "tool_calls_per_turn", "turns_per_episode"} <= set(m)
    assert m["turns_per_episode"] >= 2.0  # a grep, then the output
