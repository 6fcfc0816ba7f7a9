"""A seeded synthetic corpus and queries, for benchmarks and tests of retrieval alone.

Not the search environment's task generator (libs/envs builds corpora with planted facts,
clues and distractors): this one only needs to be deterministic, English-like (so MiniLM's
word pieces and BM25's term statistics behave as on prose) and of any size. Each document has
a topic; its sentences mix the topic's words with common ones and name made-up entities with
numbers, so a query built from one document's words has a right answer. The same seed gives
the same corpus on every machine (`random.Random`, no global state).
"""

from __future__ import annotations

import random

from slipstream.retrieval.types import Document


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_COMMON = _words(
    "the a of and to in is was for on that with as by at from it this which be are were has had "
    "been its after before during between under over about into through against among within"
)
_TOPICS: dict[str, tuple[str, ...]] = {
    "river": _words("river bank delta flood bridge ferry current barge dam valley harbour silt"),
    "music": _words("album singer chorus guitar tour label concert melody drummer studio ballad"),
    "chemistry": _words("compound reaction acid molecule catalyst solvent crystal element bond yield"),
    "football": _words("league striker goal season club match referee stadium transfer keeper"),
    "astronomy": _words("planet orbit comet telescope galaxy nebula moon star eclipse crater"),
    "law": _words("court appeal statute verdict judge tribunal contract clause plaintiff ruling"),
    "medicine": _words("patient dose trial vaccine surgeon clinic symptom therapy infection ward"),
    "railway": _words("station locomotive track signal depot carriage junction timetable gauge line"),
    "finance": _words("bond equity dividend ledger merger audit bank loan tariff quarter"),
    "botany": _words("orchid fern seed pollen root leaf canopy moss blossom species"),
    "aviation": _words("aircraft runway pilot hangar cockpit airline glider engine flight route"),
    "painting": _words("canvas portrait fresco gallery pigment easel landscape sketch mural patron"),
}
_VERBS = _words("built founded recorded measured described opened won signed studied named moved published")
_SYLLABLES = _words("ka lo mi ren tor vas bel dun esk fal gor hin jor kel mar nor pel quin ros sal tev ul vin wes")


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def _sentence(rng: random.Random, topic: tuple[str, ...], entity: str) -> str:
    words = [rng.choice(topic) if rng.random() < 0.45 else rng.choice(_COMMON) for _ in range(rng.randint(6, 14))]
    at = rng.randrange(len(words))
    words[at:at] = [entity, rng.choice(_VERBS)]
    if rng.random() < 0.5:
        words.append(f"in {rng.randint(1800, 2025)}")
    if rng.random() < 0.3:
        words.append(f"with {rng.randint(2, 9999)} {rng.choice(topic)}s")
    text = " ".join(words)
    return text[0].upper() + text[1:] + "."


def synthetic_corpus(n_docs: int, *, seed: int = 0, paragraphs: tuple[int, int] = (2, 5)) -> list[Document]:
    """`n_docs` documents `doc-00000`..., each 2-5 paragraphs of 3-6 sentences on one topic."""
    if n_docs < 0:
        raise ValueError(f"n_docs must be >= 0, got {n_docs}")
    rng = random.Random(seed)
    topics = list(_TOPICS)
    docs: list[Document] = []
    width = max(5, len(str(n_docs)))
    for i in range(n_docs):
        topic = _TOPICS[topics[rng.randrange(len(topics))]]
        entity = _name(rng)
        title = f"{entity} {rng.choice(topic)}"
        paras = []
        for _ in range(rng.randint(*paragraphs)):
            others = [entity, _name(rng), _name(rng)]
            paras.append(" ".join(_sentence(rng, topic, rng.choice(others)) for _ in range(rng.randint(3, 6))))
        docs.append(Document(doc_id=f"doc-{i:0{width}d}", title=title, text="\n\n".join(paras)))
    return docs


def synthetic_queries(docs: list[Document], n: int, *, seed: int = 0, words: int = 5) -> list[tuple[str, str]]:
    """`n` (query, source doc id) pairs: a few words drawn from one document's text, title included."""
    if not docs:
        raise ValueError("synthetic_queries needs at least one document")
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    for _ in range(n):
        doc = docs[rng.randrange(len(docs))]
        vocab = [w.strip(".,").lower() for w in doc.text.split() if len(w) > 3 and w.lower() not in _COMMON]
        picked = rng.sample(vocab, min(words - 1, len(vocab)))
        out.append((" ".join([doc.title.split()[0], *picked]), doc.doc_id))
    return out
