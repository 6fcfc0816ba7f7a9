"""Seeded search tasks, generated the way Context-1 generates them (techniques.md §4.8).

One call builds a whole corpus and the tasks over it, a pure function of (seed, options):

1. supporting documents carrying unique facts: every entity has a made-up name and attributes,
   one short document each;
2. obfuscated clues (a year becomes its decade, a place its region's description), a question
   built from them and its answer (an attribute of the last entity in the chain);
3. verification, extraction-based: each supporting document carries the quotes an extractor
   would pull (`document_quotes`, `clue_quotes`, `truth_quotes`), checked against the text by the
   normalisation cascade (quotes.py); at least ceil(2/3) of the document and clue quotes must
   match, every truth quote must, some supporting document must hold the answer, and no
   distractor may hold it. A task that fails is dropped and counted by reason. (Context-1's data
   pipeline drops just the offending distractor; issue 13 asks that the task be dropped, which is
   what we do.) `noise` simulates a generator's slips (a quoted fact paraphrased away, the answer
   leaked into a distractor) so verification has something to catch;
4. distractors: documents of the same kind that share one clue but not the other and point
   elsewhere (`distractor_clue`: the decade, or the region, which a lexical search for the
   clues matches as well as it matches the target); with `hop_distractors`, documents that name
   a later hop's entity (the only clue a search for that hop has) without being it;
5. chaining: a task of h hops follows h - 1 links (sister town, parent company, ...) from the
   entity the clues describe; the answer sits in the h-th document. `hops` is exactly that,
   cycling over min_hops..max_hops.

Several domains (web, legal, finance, email); `heldout_domain` (email, as in Context-1) is the
held-out split. Filler documents pad each domain. Texts are one or two short sentences per fact
(~150 bytes a document) so a byte-level CPU model can learn them; `doc_facts` adds more filler
facts per document for larger models.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from typing import Annotated, Literal

import msgspec

from slipstream.envs.search.quotes import answer_in, enough_quotes, quote_in
from slipstream.retrieval.types import Document

Doc = msgspec.Meta

_SYLLABLES = (
    "ar", "bel", "cor", "dan", "el", "fen", "gar", "hol", "ir", "jas", "kel", "lor", "mar", "nor", "os",
    "pel", "quin", "ros", "sar", "tal", "ur", "vel", "wen", "yor", "zan",
)  # fmt: skip
_COLORS = ("red", "blue", "green", "grey", "gold", "white", "black", "amber")
_ANIMALS = ("heron", "fox", "owl", "stag", "otter", "hawk", "wolf", "crane", "lynx", "hare")
_REGIONS = {
    "the north": "a cold northern region",
    "the coast": "a region by the sea",
    "the hills": "an upland region",
    "the plains": "a flat inland region",
    "the marsh": "a wet lowland region",
    "the valley": "a region between mountains",
}
# Added in this order by the option `regions` (7..12): more (region, decade) pairs for unique clues.
_MORE_REGIONS = {
    "the desert": "a dry sandy region",
    "the forest": "a wooded region",
    "the islands": "a region of many islands",
    "the lakes": "a region of many lakes",
    "the steppe": "a grassy treeless region",
    "the delta": "a region at a river mouth",
}


class Domain(msgspec.Struct, frozen=True):
    """How one domain writes its documents: its own nouns and phrasing, so the held-out domain
    reads differently from the training ones."""

    name: str
    prefix: str  # doc-id prefix
    kind: str  # "town", "company", ...
    place: str  # "a town in": how the region is attached
    mark: str  # "emblem": what carries the colour and animal
    link: str  # the chaining relation: "sister town"
    answer_attr: str  # what the question asks for: "river"


DOMAINS: tuple[Domain, ...] = (
    Domain("web", "w", "town", "in", "emblem", "sister town", "river"),
    Domain("legal", "l", "patent", "filed in", "figure", "cited patent", "assignee"),
    Domain("finance", "f", "company", "based in", "logo", "parent company", "chief executive"),
    Domain("email", "e", "thread", "sent from", "signature", "earlier thread", "meeting place"),
)
DOMAIN_NAMES: tuple[str, ...] = tuple(d.name for d in DOMAINS)
# With `varied_nouns`, a training domain's task draws each of its nouns from these pools (never the
# held-out domain's own), so the wording of a question varies around the clues it must be read for:
# a model trained on three fixed wordings learns them as part of the call that follows them, and the
# held-out domain's unseen words then break even the tool name it writes (issue 13, README).
_KINDS = (
    "town", "patent", "company", "village", "ship", "mill", "bridge", "guild", "school", "farm", "mine",
    "abbey", "fort", "market", "theatre", "library", "harbour", "orchard", "chapel", "workshop", "inn",
    "tower", "museum", "festival", "choir", "league", "club", "journal", "brewery", "garden",
)  # fmt: skip
_PLACES = ("in", "filed in", "based in", "found in", "built in", "set in", "located in", "kept in", "held in")
_MARKS = ("emblem", "figure", "logo", "crest", "seal", "banner", "flag", "badge", "sign", "symbol", "mascot")
_ANSWER_ATTRS = (
    "river", "assignee", "chief executive", "founder", "patron", "keeper", "mayor", "owner", "builder",
    "captain", "treasurer", "architect", "poet", "warden", "steward", "head", "chair", "curator",
)  # fmt: skip


class GeneratorOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The corpus generator's knobs."""

    seed: Annotated[int, Doc(description="Corpus seed: the same seed gives the same corpus and tasks.")] = 0
    tasks_per_domain: Annotated[int, Doc(description="Tasks generated per domain (before verification).")] = 24
    max_hops: Annotated[int, Doc(description="Hop counts min_hops..max_hops are generated evenly.")] = 3
    min_hops: Annotated[int, Doc(description="The fewest hops a task has (1..max_hops).")] = 1
    distractors: Annotated[int, Doc(description="Distractor documents per task.")] = 2
    distractor_clue: Annotated[
        Literal["decade", "region"],
        Doc(description="The clue a distractor shares with the first hop's document: its decade or its region."),
    ] = "decade"
    hop_distractors: Annotated[
        int,
        Doc(description="Per later hop, documents that name that hop's entity without being it (share its clue)."),
    ] = 0
    filler_per_domain: Annotated[int, Doc(description="Unrelated documents per domain.")] = 12
    doc_facts: Annotated[int, Doc(description="Extra filler facts per document (longer texts).")] = 0
    heldout_domain: Annotated[str, Doc(description="The domain whose tasks form the held-out split.")] = "email"
    noise: Annotated[float, Doc(description="Chance a task is generated with a slip verification must catch.")] = 0.05
    min_year: Annotated[int, Doc(description="Earliest year an entity dates from (the latest is 1999).")] = 1600
    unique_clues: Annotated[
        bool,
        Doc(description="No two documents share a (region, decade) pair: one-hop clues single out a document."),
    ] = False
    unique_first_hop: Annotated[
        bool,
        Doc(
            description="No other document shares a task's first-hop (region, decade) pair, so its clues single "
            "it out while other documents may share pairs among themselves (needs distractor_clue 'region')."
        ),
    ] = False
    short_ids: Annotated[
        bool, Doc(description="Three-digit document ids drawn at random (417), not per-domain ones (w0007).")
    ] = False
    regions: Annotated[int, Doc(description="How many regions entities lie in (6..12).")] = 6
    fixed_offsets: Annotated[
        bool,
        Doc(
            description="Copies at fixed distances: the question names the decade last, a document opens with "
            "its year and ends with its id (`Id 417.`)."
        ),
    ] = False
    varied_nouns: Annotated[
        bool,
        Doc(
            description="A training domain's task draws its nouns (kind, place, mark, asked attribute) from "
            "shared pools; the held-out domain keeps its own, never drawn."
        ),
    ] = False

    def region_map(self) -> dict[str, str]:
        """The regions in use (name -> the clue's description): the first `regions` of the list."""
        return {**_REGIONS, **dict(list(_MORE_REGIONS.items())[: self.regions - len(_REGIONS)])}

    def hops_of(self, index: int) -> int:
        """The hop count of a domain's task `index`: min_hops..max_hops in turn."""
        return self.min_hops + index % (self.max_hops - self.min_hops + 1)

    def documents(self) -> int:
        """How many documents the corpus holds (every task's hops and distractors, and the filler)."""
        hops = [self.hops_of(i) for i in range(self.tasks_per_domain)]
        per_domain = sum(hops) + sum(h - 1 for h in hops) * self.hop_distractors
        return len(DOMAINS) * (per_domain + self.tasks_per_domain * self.distractors + self.filler_per_domain)

    def __post_init__(self) -> None:
        if self.heldout_domain not in DOMAIN_NAMES:
            raise ValueError(f"heldout_domain must be one of {DOMAIN_NAMES}, got {self.heldout_domain!r}")
        if not 1 <= self.max_hops <= 6:
            raise ValueError(f"max_hops must be in 1..6, got {self.max_hops}")
        if not 1 <= self.min_hops <= self.max_hops:
            raise ValueError(f"min_hops must be in 1..max_hops ({self.max_hops}), got {self.min_hops}")
        if not 0 <= self.hop_distractors <= 10:
            raise ValueError(f"hop_distractors must be in 0..10, got {self.hop_distractors}")
        if self.distractor_clue not in ("decade", "region"):
            raise ValueError(f"distractor_clue must be 'decade' or 'region', got {self.distractor_clue!r}")
        if not 1 <= self.tasks_per_domain <= 2000:
            raise ValueError(f"tasks_per_domain must be in 1..2000, got {self.tasks_per_domain}")
        if (
            not 0 <= self.distractors <= 10
            or not 0 <= self.filler_per_domain <= 10_000
            or not 0 <= self.doc_facts <= 50
        ):
            raise ValueError("need 0 <= distractors <= 10, 0 <= filler_per_domain <= 10000, 0 <= doc_facts <= 50")
        if not 0.0 <= self.noise <= 1.0:
            raise ValueError(f"noise must be in [0, 1], got {self.noise}")
        if not 1000 <= self.min_year <= 1990:
            raise ValueError(f"min_year must be in 1000..1990, got {self.min_year}")
        if self.short_ids and self.documents() > 1000:
            raise ValueError(f"short_ids allows 1000 documents; these options make {self.documents()}")
        if not len(_REGIONS) <= self.regions <= len(_REGIONS) + len(_MORE_REGIONS):
            raise ValueError(f"regions must be in 6..12, got {self.regions}")
        pairs = self.regions * (200 - self.min_year // 10)
        if self.unique_first_hop and (self.unique_clues or self.distractor_clue != "region"):
            raise ValueError("unique_first_hop needs distractor_clue 'region' and not unique_clues")
        if self.unique_first_hop and len(DOMAINS) * self.tasks_per_domain > pairs * 3 // 4:
            raise ValueError(
                f"unique_first_hop: {len(DOMAINS) * self.tasks_per_domain} tasks need more than 3/4 of the {pairs} "
                "(region, decade) pairs; lower tasks_per_domain or min_year, or raise regions"
            )
        if self.unique_clues and self.documents() > pairs * 3 // 4:
            raise ValueError(
                f"unique_clues: {self.documents()} documents need more than 3/4 of the {pairs} (region, decade) "
                "pairs; lower tasks_per_domain, distractors, max_hops or filler_per_domain, or min_year"
            )


class SupportingDoc(msgspec.Struct, frozen=True):
    """A supporting document and the quotes an extractor pulled from it."""

    doc_id: str
    document_quotes: list[str]
    clue_quotes: list[str]
    truth_quotes: list[str]


class SearchTask(msgspec.Struct, frozen=True, kw_only=True):
    """One generated task: find `supporting` (in chain order); the last one holds `answer`."""

    key: str  # "<domain>/<n>": the canonical problem key
    domain: str
    hops: int
    question: str
    answer: str
    clues: list[str]
    supporting: list[SupportingDoc]
    distractors: list[str]
    queries: list[str]  # one search query per hop, planned from the clues (the expert's plan)

    @property
    def targets(self) -> list[str]:
        return [s.doc_id for s in self.supporting]

    @property
    def answer_docs(self) -> list[str]:
        return [self.supporting[-1].doc_id]


class GeneratedCorpus(msgspec.Struct, frozen=True):
    """The corpus, the tasks that passed verification, and what was dropped, by reason."""

    documents: list[Document]
    tasks: list[SearchTask]
    dropped: dict[str, int]
    generated: int


class _Names:
    """Unique made-up names: no two entities (or answers) share one anywhere in a corpus."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def __call__(self) -> str:
        tries = 0
        while True:
            # Two syllables while they last (short names suit a byte-level model), then three.
            parts = 2 if tries < 20 else 3
            tries += 1
            name = "".join(self.rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()
            if name not in self.used:
                self.used.add(name)
                return name


class _Entity(msgspec.Struct):
    name: str
    region: str
    year: int
    color: str
    animal: str
    link: str = ""  # the next entity's name in a chain
    answer: str = ""


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _sentences(domain: Domain, e: _Entity, *, year_first: bool = False) -> list[str]:
    place = f"{_a(domain.kind)} {domain.place} {e.region}."
    head = [f"{e.name} dates from {e.year}.", f"It is {place}"]
    s = [
        *(head if year_first else [f"{e.name} is {place}", f"It dates from {e.year}."]),
        f"Its {domain.mark} is {_a(e.color)} {e.animal}.",
    ]
    if e.link:
        s.append(f"Its {domain.link} is {e.link}.")
    if e.answer:
        s.append(f"Its {domain.answer_attr} is {e.answer}.")
    return s


def _filler_facts(rng: random.Random, names: _Names, n: int) -> list[str]:
    return [f"It once hosted {names()} for {rng.randint(2, 40)} days." for _ in range(n)]


def _new_entity(
    rng: random.Random, names: _Names, min_year: int = 1600, regions: tuple[str, ...] = (), **fixed: object
) -> _Entity:
    values: dict[str, object] = {
        "name": names(),
        "region": rng.choice(regions or sorted(_REGIONS)),
        "year": rng.randint(min_year, 1999),
        "color": rng.choice(_COLORS),
        "animal": rng.choice(_ANIMALS),
    }
    values.update(fixed)
    return _Entity(**values)  # type: ignore[arg-type]


def _question(domain: Domain, hops: int, clues: list[str], *, decade_last: bool = False) -> str:
    chain = "".join(f"the {domain.link} of " for _ in range(hops - 1))
    first, second = (clues[1], clues[0]) if decade_last else (clues[0], clues[1])
    return f"What is the {domain.answer_attr} of {chain}the {domain.kind} that {first} and {second}?"


class _Builder:
    def __init__(self, options: GeneratorOptions) -> None:
        self.o = options
        self.rng = random.Random(f"search-corpus|{options.seed}")
        self.names = _Names(self.rng)
        self.docs: list[Document] = []
        self.counts: Counter[str] = Counter()
        self.pairs: set[tuple[str, int]] = set()  # (region, decade) of every document, with unique_clues
        # With unique_first_hop: one (region, decade) pair per task, drawn up front, that only the
        # task's first hop has (its own stream, so the other draws stay as they were).
        self.reserved: set[tuple[str, int]] = set()
        self.first_pairs: list[tuple[str, int]] = []
        if options.unique_first_hop:
            every = [(r, d) for r in sorted(options.region_map()) for d in range(options.min_year // 10, 200)]
            drawn = random.Random(f"search-first-hops|{options.seed}").sample(
                every, len(DOMAINS) * options.tasks_per_domain
            )
            self.reserved = set(drawn)
            self.first_pairs = drawn[::-1]
        self.ids: set[str] = set()
        self.region_map = options.region_map()
        self.regions = tuple(sorted(self.region_map))
        # Its own stream, so varied nouns leave every other draw (names, clues, ids) as it was.
        self.noun_rng = random.Random(f"search-nouns|{options.seed}")
        held = next(d for d in DOMAINS if d.name == options.heldout_domain)
        self.pools = tuple(
            tuple(w for w in pool if w != getattr(held, slot))
            for slot, pool in (("kind", _KINDS), ("place", _PLACES), ("mark", _MARKS), ("answer_attr", _ANSWER_ATTRS))
        )

    def nouns(self, domain: Domain) -> Domain:
        """The domain as one task writes it: its own nouns, or with `varied_nouns` (training domains
        only) each drawn from the pools; the link follows the kind ("sister mill")."""
        if not self.o.varied_nouns or domain.name == self.o.heldout_domain:
            return domain
        kind, place, mark, attr = (self.noun_rng.choice(pool) for pool in self.pools)
        return msgspec.structs.replace(
            domain, kind=kind, place=place, mark=mark, answer_attr=attr, link=f"sister {kind}"
        )

    def entity(self, spare: int = 0, *, first: bool = False, **fixed: object) -> _Entity:
        """A new entity. With `unique_clues`, its (region, decade) pair is one no document has yet
        (redrawn until free; a fixed region or year is kept), and `spare` other regions are still
        free in its decade (for the distractors, which share it). With `unique_first_hop`, a
        task's `first` entity takes a pair no document has, and no later document takes it."""
        e = _new_entity(self.rng, self.names, self.o.min_year, self.regions, **fixed)
        if self.o.unique_first_hop:
            return self._first_hop_unique(e, first, fixed)
        if not self.o.unique_clues:
            return e
        for _ in range(10_000):
            free = [r for r in self.regions if (r, e.year // 10) not in self.pairs]
            if e.region in free and len(free) > spare:
                self.pairs.add((e.region, e.year // 10))
                return e
            if "region" not in fixed:
                e.region = self.rng.choice(self.regions)
            if "year" not in fixed:
                e.year = self.rng.randint(self.o.min_year, 1999)
        raise ValueError(f"unique_clues: no free (region, decade) pair left for {fixed or 'an entity'}")

    def _first_hop_unique(self, e: _Entity, first: bool, fixed: dict[str, object]) -> _Entity:
        if first:
            # The next of the pairs drawn up front for first hops: no document before or after has it.
            region, decade = self.first_pairs.pop()
            e.region, e.year = region, decade * 10 + self.rng.randint(0, 9)
            return e
        for _ in range(10_000):
            if (e.region, e.year // 10) not in self.reserved:
                return e
            if "region" not in fixed:
                e.region = self.rng.choice(self.regions)
            if "year" not in fixed:
                e.year = self.rng.randint(self.o.min_year, 1999)
        raise ValueError(f"unique_first_hop: no (region, decade) pair left for {fixed or 'an entity'}")

    def add(self, domain: Domain, entity: _Entity, extra: list[str] | None = None) -> str:
        doc_id = f"{domain.prefix}{self.counts[domain.name]:04d}"
        while self.o.short_ids and (doc_id in self.ids or len(doc_id) != 3):
            doc_id = f"{self.rng.randrange(1000):03d}"
        self.ids.add(doc_id)
        self.counts[domain.name] += 1
        facts = (
            _sentences(domain, entity, year_first=self.o.fixed_offsets)
            + _filler_facts(self.rng, self.names, self.o.doc_facts)
            + (extra or [])
        )
        if self.o.fixed_offsets:
            # The last words of every result block: the id a final output copies, at a fixed
            # distance before the model's next turn whatever the document says.
            facts.append(f"Id {doc_id}.")
        self.docs.append(Document(doc_id=doc_id, title=entity.name, text=" ".join(facts)))
        return doc_id

    def _region_distractor(self, first: _Entity) -> _Entity:
        """Same region as the first hop, another decade: a search for the clues finds it as readily."""
        if self.o.unique_clues or self.o.unique_first_hop:
            return self.entity(region=first.region)  # its (region, decade) pair differs from the target's
        year = _other_decade_year(self.rng, self.o.min_year, first.year // 10)
        return self.entity(region=first.region, year=year)

    def task(self, domain: Domain, index: int, hops: int) -> SearchTask:
        rng = self.rng
        domain = self.nouns(domain)
        chain = [self.entity(spare=self.o.distractors if i == 0 else 0, first=i == 0) for i in range(hops)]
        for a, b in itertools.pairwise(chain):
            a.link = b.name
        chain[-1].answer = self.names()
        first = chain[0]
        answer = chain[-1].answer
        # Obfuscated clues: the decade, not the year; the region's description, not its name.
        clues = [f"dates from the {first.year // 10 * 10}s", f"lies in {self.region_map[first.region]}"]
        clue_quotes = [f"dates from {first.year}", f"{domain.place} {first.region}"]
        slip = rng.random() < self.o.noise
        slip_kind = rng.choice(("paraphrase", "leak")) if slip else ""
        supporting = []
        for i, entity in enumerate(chain):
            truth = (
                [f"Its {domain.link} is {entity.link}"]
                if entity.link
                else [f"Its {domain.answer_attr} is {entity.answer}"]
            )
            doc_quotes = [
                f"{entity.name} dates from {entity.year}"
                if self.o.fixed_offsets
                else f"{entity.name} is {_a(domain.kind)}",
                f"Its {domain.mark} is {_a(entity.color)} {entity.animal}",
            ]
            if slip_kind == "paraphrase" and i == hops - 1:
                # The generator wrote a paraphrase into the document; the extractor quoted the fact.
                entity.answer = ""
                doc_id = self.add(domain, entity, extra=[f"Locals name {answer} when asked about it."])
            else:
                doc_id = self.add(domain, entity)
            supporting.append(
                SupportingDoc(
                    doc_id=doc_id,
                    document_quotes=doc_quotes,
                    clue_quotes=clue_quotes if i == 0 else [],
                    truth_quotes=truth,
                )
            )
        distractors = []
        for d in range(self.o.distractors):
            if self.o.distractor_clue == "region":
                other = self._region_distractor(first)
            else:
                # Same decade clue, another region, another chain: it matches one clue and points elsewhere.
                taken = {r for r, dec in self.pairs if dec == first.year // 10} if self.o.unique_clues else set()
                regions = [r for r in self.regions if r != first.region and r not in taken]
                if not regions:
                    raise ValueError(f"unique_clues: no region left in the {first.year // 10 * 10}s for a distractor")
                region = rng.choice(regions)
                other = self.entity(region=region, year=first.year // 10 * 10 + rng.randint(0, 9))
            other.link = self.names() if hops > 1 else ""
            other.answer = self.names() if hops == 1 else ""
            if slip_kind == "leak" and d == 0:
                distractors.append(self.add(domain, other, extra=[f"It traded with {answer}."]))
            else:
                distractors.append(self.add(domain, other))
        for e in chain[1:]:
            for _ in range(self.o.hop_distractors):
                # Names the hop's entity, the one clue a search for it has, and is not it.
                other = self.entity()
                other.link = self.names()
                days = rng.randint(2, 40)
                distractors.append(self.add(domain, other, extra=[f"It once hosted {e.name} for {days} days."]))
        queries = [f"{domain.kind} {first.region.split()[-1]} {first.year // 10 * 10}s"] + [e.name for e in chain[1:]]
        return SearchTask(
            key=f"{domain.name}/{index}",
            domain=domain.name,
            hops=hops,
            question=_question(domain, hops, clues, decade_last=self.o.fixed_offsets),
            answer=answer,
            clues=clues,
            supporting=supporting,
            distractors=distractors,
            queries=queries,
        )


def _other_decade_year(rng: random.Random, min_year: int, decade: int) -> int:
    """A year in [min_year, 1999] outside `decade` (a decade number: 187 for the 1870s)."""
    while True:
        year = rng.randint(min_year, 1999)
        if year // 10 != decade:
            return year


def verify(task: SearchTask, texts: dict[str, str]) -> str | None:
    """Why `task` fails extraction-based verification against the documents' `texts`, or None."""
    for s in task.supporting:
        text = texts.get(s.doc_id)
        if text is None:
            return "missing_document"
        if not enough_quotes(s.document_quotes, text):
            return "document_quotes"
        if s.clue_quotes and not enough_quotes(s.clue_quotes, text):
            return "clue_quotes"
        if not all(quote_in(q, text) for q in s.truth_quotes):
            return "truth_quotes"
    if not any(answer_in(task.answer, texts[s.doc_id]) for s in task.supporting):
        return "no_answer_document"
    if any(answer_in(task.answer, texts.get(d, "")) for d in task.distractors):
        return "distractor_has_answer"
    return None


def generate_corpus(options: GeneratorOptions = GeneratorOptions()) -> GeneratedCorpus:
    """The corpus and its verified tasks; hop counts cycle min_hops..max_hops within each domain."""
    b = _Builder(options)
    candidates: list[SearchTask] = []
    for domain in DOMAINS:
        for i in range(options.tasks_per_domain):
            candidates.append(b.task(domain, i, hops=options.hops_of(i)))
        for _ in range(options.filler_per_domain):
            e = b.entity()
            e.link = b.names()
            b.add(domain, e)
    texts = {d.doc_id: d.text for d in b.docs}
    kept, dropped = [], Counter[str]()
    for t in candidates:
        reason = verify(t, texts)
        if reason is None:
            kept.append(t)
        else:
            dropped[reason] += 1
    return GeneratedCorpus(
        documents=b.docs, tasks=kept, dropped=dict(sorted(dropped.items())), generated=len(candidates)
    )


def curriculum_weights(phase: int, max_hops: int) -> list[float]:
    """Hop-count mix for a curriculum phase: phase 1 skewed to few hops, phase 2 to many.

    Weights over hops 1..max_hops: phase 1 falls as 2^-(h-1), phase 2 rises as 2^(h-1).
    """
    if phase not in (1, 2):
        raise ValueError(f"curriculum phase must be 1 or 2, got {phase}")
    raw = [2.0 ** (-(h - 1) if phase == 1 else h - 1) for h in range(1, max_hops + 1)]
    total = sum(raw)
    return [w / total for w in raw]
