"""A six-document corpus for the search tool tests (unit, contract, fail-over): each question has one right document."""

from __future__ import annotations

from pathlib import Path

from slipstream.retrieval import Document
from slipstream.retrieval.dense import MiniLM
from slipstream.retrieval.index import IndexParams, build_index, corpus_key, save_index
from slipstream.store import LocalObjectStore

PARAMS = IndexParams(max_chunk_tokens=12, counter="approx")
DOCS = [
    Document(
        doc_id="river",
        title="The Varlo river",
        text="The Varlo river floods every spring.\n\nBarges carry silt and grain downstream to the harbour.\n\n"
        "A stone bridge crosses the river at Dunmore.",
    ),
    Document(
        doc_id="music",
        title="Kestrel Lane (band)",
        text="Kestrel Lane recorded their first album in a barn.\n\nThe drummer left the band before the tour.",
    ),
    Document(
        doc_id="chem",
        title="Sodium chloride",
        text="Table salt is a crystal of sodium and chlorine.\n\nIt dissolves readily in water.",
    ),
    Document(
        doc_id="space",
        title="Comet Halvor",
        text="Comet Halvor returns every 76 years.\n\nIts tail points away from the sun.",
    ),
    Document(
        doc_id="law",
        title="Appeal of Brandt",
        text="The court of appeal overturned the verdict against Brandt.\n\nThe judge cited a clause of the contract.",
    ),
    Document(
        doc_id="rail",
        title="Oakridge junction",
        text="Trains from four lines meet at Oakridge junction.\n\nThe signal box was built in 1911.",
    ),
]


def stored_index(root: Path, encoder: MiniLM) -> str:
    """Build the corpus's index into a local object store at `root`; its key prefix."""
    key = corpus_key(DOCS, PARAMS)
    save_index(LocalObjectStore(root), key, build_index(DOCS, encoder, PARAMS))
    return key
