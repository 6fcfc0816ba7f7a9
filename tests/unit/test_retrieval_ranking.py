"""Retrieval's pure parts with hand-computed values: chunking, reciprocal-rank fusion, top-k, the budget cut."""

from __future__ import annotations

import numpy as np
import pytest

from slipstream.retrieval import Chunk, Document, chunk_corpus, chunk_document, cut_to_budget, doc_of, rrf, utf8_bytes
from slipstream.retrieval.chunking import approx_tokens, counter_named
from slipstream.retrieval.ranking import top_k

pytestmark = pytest.mark.unit


def words(n: int, start: int = 0) -> str:
    return " ".join(f"w{i:03d}" for i in range(start, start + n))  # 4 bytes a word + a space


# --------------------------------------------------------------------------- chunking


def test_short_paragraphs_pack_into_one_chunk_with_stable_ids() -> None:
    doc = Document(doc_id="d1", title="T", text="Alpha beta.\n\nGamma delta.")
    [only] = chunk_document(doc, max_tokens=100, count=utf8_bytes)
    assert (only.chunk_id, only.doc_id, only.text, only.tokens) == ("d1#0", "d1", "Alpha beta.\nGamma delta.", 24)


def test_paragraphs_pack_greedily_up_to_the_size_and_never_split_when_they_fit() -> None:
    a, b, c = words(10), words(10, 10), words(10, 20)  # 49 bytes each
    doc = Document(doc_id="d", text=f"{a}\n\n{b}\n\n{c}")
    chunks = chunk_document(doc, max_tokens=100, count=utf8_bytes)
    # a + "\n" + b = 99 bytes fits; adding c would make 149.
    assert [c_.text for c_ in chunks] == [f"{a}\n{b}", c]
    assert [c_.tokens for c_ in chunks] == [99, 49]
    assert [c_.chunk_id for c_ in chunks] == ["d#0", "d#1"]


def test_a_long_paragraph_splits_at_sentences_then_at_words() -> None:
    s1 = "One two three."  # 14 bytes
    s2 = words(30) + "."  # 150 bytes: longer than the chunk size on its own
    doc = Document(doc_id="x", text=f"{s1} {s2}")
    chunks = chunk_document(doc, max_tokens=40, count=utf8_bytes)
    assert all(c.tokens <= 40 for c in chunks)
    # Every word survives, in order, and nothing is duplicated.
    assert " ".join(c.text.replace("\n", " ") for c in chunks).split() == f"{s1} {s2}".split()
    assert chunks[0].text.startswith("One two three.")


def test_bad_documents_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'a#b'"):
        chunk_document(Document(doc_id="a#b", text="x"), max_tokens=10, count=utf8_bytes)
    with pytest.raises(ValueError, match="appears twice"):
        chunk_corpus([Document(doc_id="a", text="x"), Document(doc_id="a", text="y")], max_tokens=10, count=utf8_bytes)
    with pytest.raises(ValueError, match="max_tokens"):
        chunk_document(Document(doc_id="a", text="x"), max_tokens=0, count=utf8_bytes)
    with pytest.raises(ValueError, match="unknown token counter 'nope'"):
        counter_named("nope")


def test_counters_and_chunk_id_round_trip() -> None:
    assert utf8_bytes("héllo") == 6 and approx_tokens("abcdefghi") == 3 and approx_tokens("") == 0
    assert doc_of("doc-7#12") == "doc-7" and doc_of("a#b#3") == "a#b"
    with pytest.raises(ValueError, match="not a chunk id"):
        doc_of("doc-7")


# --------------------------------------------------------------------------- RRF


def test_rrf_by_hand_with_k_60() -> None:
    fused = dict(rrf([["a", "b", "c"], ["c", "a", "d"]], k=60))
    assert fused["a"] == pytest.approx(1 / 61 + 1 / 62)  # rank 1 and rank 2
    assert fused["c"] == pytest.approx(1 / 63 + 1 / 61)
    assert fused["b"] == pytest.approx(1 / 62)
    assert fused["d"] == pytest.approx(1 / 63)
    assert [item for item, _ in rrf([["a", "b", "c"], ["c", "a", "d"]])] == ["a", "c", "b", "d"]


def test_rrf_ties_keep_first_appearance_and_k_changes_the_order() -> None:
    # x is 1st in one list, y 1st in the other: equal scores, x seen first.
    assert [i for i, _ in rrf([["x", "y"], ["y", "x"]])] == ["x", "y"]
    # k=0: a lone first place (1/1) beats third place twice (1/3 + 1/3); at k=60 agreement wins
    # (2/63 > 1/61).
    lists = [["solo", "x", "both"], ["other", "y", "both"]]
    assert [i for i, _ in rrf(lists, k=0)][:2] == ["solo", "other"]
    assert next(i for i, _ in rrf(lists, k=60)) == "both"
    with pytest.raises(ValueError, match="k must be >= 0"):
        rrf([], k=-1)


# --------------------------------------------------------------------------- top-k and exclusion


def test_top_k_best_first_ties_by_index_and_masked_rows_never_appear() -> None:
    scores = np.array([0.5, 0.9, 0.1, 0.9, 0.7])
    assert top_k(scores, 3).tolist() == [1, 3, 4]
    assert top_k(scores, 3, masked=np.array([1, 4])).tolist() == [3, 0, 2]
    assert top_k(scores, 10, masked=np.array([0, 1, 2, 3, 4])).tolist() == []
    assert top_k(scores, 0).tolist() == []


# --------------------------------------------------------------------------- budget cut


def chunk(cid: str, tokens: int) -> Chunk:
    return Chunk(chunk_id=cid, doc_id=cid.split("#")[0], text="t", tokens=tokens)


def test_budget_cut_takes_whole_chunks_best_first_and_skips_one_that_does_not_fit() -> None:
    ranked = [chunk("a#0", 40), chunk("b#0", 50), chunk("c#0", 30), chunk("d#0", 10), chunk("e#0", 5)]
    # 40 fits (60 left), 50 fits (10 left), 30 does not (skipped), 10 fits (0 left): stop.
    assert [c.chunk_id for c in cut_to_budget(ranked, 100)] == ["a#0", "b#0", "d#0"]
    assert sum(c.tokens for c in cut_to_budget(ranked, 100)) == 100
    assert [c.chunk_id for c in cut_to_budget(ranked, 39)] == ["c#0", "e#0"]
    assert cut_to_budget(ranked, 0) == [] and cut_to_budget(ranked, 4) == []
    with pytest.raises(ValueError, match="budget_tokens"):
        cut_to_budget(ranked, -1)
