"""The search task generator: determinism, verification (planted bad tasks), hop counts, quotes."""

from __future__ import annotations

import msgspec
import pytest

from slipstream.envs.search.generator import (
    DOMAIN_NAMES,
    GeneratorOptions,
    SearchTask,
    SupportingDoc,
    curriculum_weights,
    generate_corpus,
    verify,
)
from slipstream.envs.search.quotes import answer_in, quote_step, required_matches

pytestmark = pytest.mark.unit


def test_same_seed_same_corpus_and_tasks_other_seed_differs() -> None:
    a = generate_corpus(GeneratorOptions(seed=7))
    b = generate_corpus(GeneratorOptions(seed=7))
    c = generate_corpus(GeneratorOptions(seed=8))
    assert msgspec.json.encode(a) == msgspec.json.encode(b)
    assert [d.text for d in a.documents] != [d.text for d in c.documents]
    assert len({d.doc_id for d in a.documents}) == len(a.documents)


def test_every_kept_task_verifies_and_its_documents_are_in_the_corpus() -> None:
    corpus = generate_corpus(GeneratorOptions(seed=1, noise=0.0))
    texts = {d.doc_id: d.text for d in corpus.documents}
    assert corpus.dropped == {} and len(corpus.tasks) == corpus.generated == 4 * 24
    assert {t.domain for t in corpus.tasks} == set(DOMAIN_NAMES)
    for t in corpus.tasks:
        assert verify(t, texts) is None
        assert answer_in(t.answer, texts[t.answer_docs[0]])
        assert all(not answer_in(t.answer, texts[d]) for d in t.distractors)
        assert t.answer not in t.question


def test_hop_count_is_as_asked() -> None:
    corpus = generate_corpus(GeneratorOptions(seed=2, max_hops=4, noise=0.0))
    texts = {d.doc_id: d.text for d in corpus.documents}
    assert {t.hops for t in corpus.tasks} == {1, 2, 3, 4}
    for t in corpus.tasks:
        assert len(t.supporting) == t.hops == len(t.queries)
        assert t.question.count("of the ") == t.hops  # the answer attribute, then one per link
        # Each document names the next one's entity: the chain really has `hops` documents.
        for here, nxt in zip(t.supporting, t.supporting[1:], strict=False):
            title = next(d.title for d in corpus.documents if d.doc_id == nxt.doc_id)
            assert title in texts[here.doc_id]


def test_documents_are_short_enough_for_a_byte_level_model() -> None:
    corpus = generate_corpus(GeneratorOptions(seed=0))
    longest = max(len(d.text.encode()) for d in corpus.documents)
    assert longest < 200, longest
    bigger = generate_corpus(GeneratorOptions(seed=0, doc_facts=6))
    assert max(len(d.text) for d in bigger.documents) > 2 * longest


def _good(corpus_seed: int = 3) -> tuple[SearchTask, dict[str, str]]:
    corpus = generate_corpus(GeneratorOptions(seed=corpus_seed, noise=0.0))
    task = next(t for t in corpus.tasks if t.hops == 2)
    return task, {d.doc_id: d.text for d in corpus.documents}


def test_planted_bad_tasks_are_caught_with_their_reason() -> None:
    task, texts = _good()
    assert verify(task, texts) is None
    # A truth quote that is not in its document.
    s0 = task.supporting[0]
    bad_quote = msgspec.structs.replace(s0, truth_quotes=["Its sister town is Nowhereville"])
    planted = msgspec.structs.replace(task, supporting=[bad_quote, *task.supporting[1:]])
    assert verify(planted, texts) == "truth_quotes"
    # Document quotes mostly absent (1 of 3 found, ceil(2/3 * 3) = 2 needed).
    missing = msgspec.structs.replace(s0, document_quotes=[s0.document_quotes[0], "a quote not there", "nor this"])
    assert verify(msgspec.structs.replace(task, supporting=[missing, *task.supporting[1:]]), texts) == "document_quotes"
    # The answer inside a distractor.
    leaked = dict(texts)
    leaked[task.distractors[0]] += f" It traded with {task.answer.upper()}."
    assert verify(task, leaked) == "distractor_has_answer"


def test_generator_slips_are_dropped_and_counted() -> None:
    clean = generate_corpus(GeneratorOptions(seed=4, noise=0.0))
    noisy = generate_corpus(GeneratorOptions(seed=4, noise=1.0))
    assert noisy.generated == clean.generated
    # Every task slipped (a paraphrased answer fact or a leaked answer): every one is dropped.
    assert noisy.tasks == []
    assert sum(noisy.dropped.values()) == noisy.generated
    assert set(noisy.dropped) == {"truth_quotes", "distractor_has_answer"}
    some = generate_corpus(GeneratorOptions(seed=4, noise=0.2))
    assert len(some.tasks) + sum(some.dropped.values()) == some.generated and 0 < len(some.tasks) < some.generated


def test_quote_cascade_steps() -> None:
    text = "The  Harbour of\nOrlan — see [the map](http://x.org/m) — dates from “1742”, it's said."
    assert quote_step("harbour OF", text) == "case"
    assert quote_step("harbour of orlan", text) == "whitespace"
    assert quote_step("see the map", text) == "links"
    assert quote_step('dates from "1742"', text) == "unicode"
    # The first 5 words longer than 3 letters (harbour, orlan, dates, from, 1742) in order; the rest is ignored.
    assert quote_step("Harbour in Orlan dates from 1742 onwards maybe", text) == "first_words"
    assert quote_step("Harbour Orlan dates from somewhere", text) is None
    assert quote_step("Harbour of Velmar", text) is None
    assert quote_step("", text) is None
    assert [required_matches(n) for n in (1, 2, 3, 4, 6)] == [1, 2, 2, 3, 4]


def test_curriculum_by_hop_count() -> None:
    low, high = curriculum_weights(1, 3), curriculum_weights(2, 3)
    assert low == pytest.approx([4 / 7, 2 / 7, 1 / 7]) and high == pytest.approx([1 / 7, 2 / 7, 4 / 7])
    with pytest.raises(ValueError, match="phase"):
        curriculum_weights(3, 3)


def test_bad_options_are_named() -> None:
    with pytest.raises(ValueError, match="heldout_domain"):
        GeneratorOptions(heldout_domain="poetry")
    with pytest.raises(ValueError, match="max_hops"):
        GeneratorOptions(max_hops=0)


def test_unique_clues_single_out_each_document_and_short_ids_are_three_digits() -> None:
    options = GeneratorOptions(seed=5, max_hops=1, tasks_per_domain=56, distractors=1, filler_per_domain=0)
    loose = generate_corpus(options)
    strict = generate_corpus(msgspec.structs.replace(options, min_year=1000, unique_clues=True, short_ids=True))

    def pairs(corpus: object) -> list[tuple[str, str]]:
        # (region, decade) from each text: "X is a town in the marsh. It dates from 1765."
        out = []
        for d in corpus.documents:  # type: ignore[attr-defined]
            region = d.text.split(". It dates from ")[0].rsplit(" ", 1)[-1]
            out.append((region, d.text.split("It dates from ")[1][:3]))
        return out

    # 448 documents in 6 regions x 40 decades: the default corpus repeats pairs, the strict one never does.
    assert len(set(pairs(loose))) < len(loose.documents)
    assert len(set(pairs(strict))) == len(strict.documents) == 448
    assert all(1000 <= int(d.text.split("It dates from ")[1][:4]) <= 1999 for d in strict.documents)
    ids = [d.doc_id for d in strict.documents]
    assert len(set(ids)) == len(ids) and all(len(i) == 3 and i.isdigit() for i in ids)
    assert ids != sorted(ids)  # drawn at random: the id says nothing of the domain
    texts = {d.doc_id: d.text for d in strict.documents}
    # Verification still holds, and each task's distractor shares its decade, not its region.
    for t in strict.tasks:
        assert verify(t, texts) is None
        (target,) = t.targets
        (distractor,) = t.distractors
        assert texts[target].split("dates from ")[1][:3] == texts[distractor].split("dates from ")[1][:3]
    with pytest.raises(ValueError, match="unique_clues: 512 documents"):
        msgspec.structs.replace(options, tasks_per_domain=64, min_year=1000, unique_clues=True)
    with pytest.raises(ValueError, match="short_ids allows 1000 documents"):
        GeneratorOptions(tasks_per_domain=200, short_ids=True)
    with pytest.raises(ValueError, match="min_year"):
        GeneratorOptions(min_year=900)
    # Twelve regions: 1,200 pairs, room for 900 one-hop documents, every region in use.
    wide = generate_corpus(
        msgspec.structs.replace(
            options, tasks_per_domain=225, distractors=0, min_year=1000, unique_clues=True, short_ids=True, regions=12
        )
    )
    assert len(set(pairs(wide))) == len(wide.documents) == 900 and len({r for r, _ in pairs(wide)}) == 12
    assert any("a region of many islands" in t.question for t in wide.tasks)
    with pytest.raises(ValueError, match=r"regions must be in 6\.\.12"):
        GeneratorOptions(regions=13)


def test_varied_nouns_vary_training_wording_and_keep_the_held_out_domain_its_own() -> None:
    options = GeneratorOptions(
        seed=3, max_hops=2, tasks_per_domain=40, distractors=1, filler_per_domain=0, min_year=1000, unique_clues=True
    )
    fixed = generate_corpus(options)
    varied = generate_corpus(msgspec.structs.replace(options, varied_nouns=True))
    assert msgspec.json.encode(varied) == msgspec.json.encode(
        generate_corpus(msgspec.structs.replace(options, varied_nouns=True))
    )
    # Its own random stream: names, ids, years and regions are those of the fixed corpus, only nouns differ.
    assert [(d.doc_id, d.title) for d in varied.documents] == [(d.doc_id, d.title) for d in fixed.documents]
    assert [t.key for t in varied.tasks] == [t.key for t in fixed.tasks]
    assert [t.clues for t in varied.tasks] == [t.clues for t in fixed.tasks]
    texts = {d.doc_id: d.text for d in varied.documents}
    assert all(verify(t, texts) is None for t in varied.tasks)

    def kind(question: str) -> str:  # "What is the <attr> of [the sister <kind> of ]the <kind> that ..."
        return question.split(" that ")[0].rsplit("the ", 1)[1]

    train = [t for t in varied.tasks if t.domain != "email"]
    held = [t for t in varied.tasks if t.domain == "email"]
    assert len({kind(t.question) for t in train}) >= 15  # of 30 kinds, over 3 x 40 tasks
    assert {kind(t.question) for t in held} == {"thread"}
    assert all(t.question.startswith("What is the meeting place of ") for t in held)
    assert [t.question for t in held] == [t.question for t in fixed.tasks if t.domain == "email"]
    # No training document or question uses a held-out noun; a chained question names its link.
    email_words = ("thread", "meeting place", "signature", "sent from")
    train_docs = {s.doc_id for t in train for s in t.supporting} | {d for t in train for d in t.distractors}
    assert not any(w in texts[d] or w in t.question for w in email_words for t in train for d in train_docs)
    assert any(" is an " in texts[d] for d in train_docs)  # "It is an orchard built in the hills."
    assert not any(f" is a {v}" in texts[d] for v in "aeiou" for d in train_docs)
    two_hop = next(t for t in train if t.hops == 2)
    assert f"the sister {kind(two_hop.question)} of the" in two_hop.question


def test_supporting_doc_struct_roundtrips() -> None:
    s = SupportingDoc(doc_id="w0001", document_quotes=["a"], clue_quotes=[], truth_quotes=["b"])
    assert msgspec.json.decode(msgspec.json.encode(s), type=SupportingDoc) == s


def test_the_pruning_plan_corpus_hops_distractors_and_first_hop_clues() -> None:
    """Issue 33's corpus: 2-3 hops, distractors sharing the first hop's region, documents naming
    each later hop's entity, and first-hop clues no other document shares."""
    options = GeneratorOptions(
        seed=3,
        min_hops=2,
        max_hops=3,
        tasks_per_domain=30,
        distractors=3,
        distractor_clue="region",
        hop_distractors=2,
        filler_per_domain=20,
        regions=12,
        min_year=1000,
        unique_first_hop=True,
    )
    corpus = generate_corpus(options)
    assert len(corpus.documents) == options.documents()
    assert {t.hops for t in corpus.tasks} == {2, 3}
    texts = {d.doc_id: d.text for d in corpus.documents}
    titles = {d.doc_id: d.title for d in corpus.documents}

    def clue(text: str) -> tuple[str, str]:
        return text.split(". It dates from ")[0].rsplit(" ", 1)[-1], text.split("It dates from ")[1][:3]

    firsts = {clue(texts[t.targets[0]]): t.targets[0] for t in corpus.tasks}
    assert len(firsts) == len(corpus.tasks)
    for doc_id, text in texts.items():
        owner = firsts.get(clue(text))
        assert owner in (None, doc_id), f"{doc_id} shares the first-hop clues of {owner}"
    for t in corpus.tasks:
        assert verify(t, texts) is None
        region = clue(texts[t.targets[0]])[0]
        shares_region, names_a_hop = t.distractors[:3], t.distractors[3:]
        assert all(clue(texts[d])[0] == region for d in shares_region)
        assert len(names_a_hop) == 2 * (t.hops - 1)
        for k, later in enumerate(t.targets[1:]):
            for d in names_a_hop[2 * k : 2 * k + 2]:
                assert titles[later] in texts[d] and d not in t.targets
    # The defaults are the old corpus: hops cycle from 1, no new documents.
    old = GeneratorOptions(seed=3)
    assert [t.hops for t in generate_corpus(old).tasks][:3] == [1, 2, 3] and old.documents() == generate_corpus(
        old
    ).documents.__len__()
    with pytest.raises(ValueError, match="min_hops"):
        GeneratorOptions(min_hops=4, max_hops=3)
    with pytest.raises(ValueError, match="unique_first_hop needs distractor_clue 'region'"):
        GeneratorOptions(unique_first_hop=True)
    with pytest.raises(ValueError, match="unique_first_hop: 1200 tasks"):
        msgspec.structs.replace(options, tasks_per_domain=300)
