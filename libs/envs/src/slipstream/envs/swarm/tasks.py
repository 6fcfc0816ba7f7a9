"""Swarm tasks: several search items in one prompt, drawn from the `search` corpus.

- wide: N independent items (N in [wide_min, wide_max]), each a search task of `wide_hops`
  hops (1 in the CPU demo): find every item's documents.
- deep: `deep_branches` branches, each a `deep_hops`-hop chain (find the entity the clues
  describe, then follow its links): every branch's documents must all be found before the one
  final answer (delayed aggregation). A branch is sequential, so a sub-agent takes several steps
  on it and a serial orchestrator pays every branch's steps one after the other.

The prompt lists the items' questions, one per line, under a fixed header; it never says how
to work (no "in parallel"). The reference is every required document id, item by item; the
final answer is `<docs>id id ...</docs>`. Items are the search corpus's train-split tasks (the
domains the sub-agents' search skill was warm-started on); a task's key is its kind and its
items' keys. The held-out split (`SwarmOptions.heldout_items`) is either

- `combinations` (the default): a hash of the task key (one in `heldout_one_in` held out), so
  held-out tasks are new combinations of items that train tasks also use: it measures the
  orchestration of an unseen set, not new retrieval; or
- `unseen` (issue 32): every document is given a split by a hash of its id (one in
  `heldout_one_in` held out); an item whose documents are all held out is a held-out item, one
  whose documents are all train a train item (an item straddling both is used by neither), and a
  task draws its items from its split's items only. A held-out task's documents, and so the
  entities they describe and the questions naming them, never occur in a train task.

The number of items N of a wide task is drawn from `item_counts` (e.g. {2, 4, 8}: where
parallelism pays grows with N) or from wide_min..wide_max. In `single` mode the prompt opens with
`SINGLE_TAG`, a line a byte-level model sees (it never sees a system prompt), so the single
agent's prompt is its own.

Two layouts (`SwarmOptions.layout`):

- `lines`: each question as the search corpus words it, one per line;
- `brief`: each one-hop question in its brief form (below), unpadded, one per line: for an
  orchestrator that copies nothing (`by_reference`), the shortest prompt whose items a
  sub-agent can search (the decade last, as its grep copies it);
- `fixed`: each one-hop question in its brief form (`brief`: `brewery: a region by the sea,
  1730s`, what names its document), right-justified to `BRIEF_WIDTH`, and every prompt line as
  wide as the assign_task call that carries that brief. With a fixed number of items, each byte
  of an assignment then sits one fixed distance after the byte it copies, whatever the other
  questions say: the only kind of copy the byte-level micro model forms quickly (libs/envs
  README, "swarm"). The brief is also the item's question: what the sub-agent is assigned.

Each item travels in `metadata["items"]` (JSON: key, question, targets, queries) so the scripted
orchestrator and the metrics can read it; the policy never sees metadata.
"""

from __future__ import annotations

import hashlib
import random
import re
import string
from collections.abc import Sequence
from typing import Literal

import msgspec

from slipstream.envs.search.env import question_prompt
from slipstream.envs.search.expert import call
from slipstream.envs.search.generator import SearchTask
from slipstream.envs.swarm.tools import ASSIGN

HEADER = "Find the documents that answer all of:\n"
SINGLE_TAG = "[single]\n"
"""The first line of a single-mode prompt: the mode token a byte-level model can see."""
AGENT_NAMES = string.ascii_lowercase
"""The scripted orchestrator's per-item sub-agent names: one byte each, as wide as `LAYOUT_AGENT`."""
Layout = Literal["lines", "fixed", "brief"]
BRIEF_WIDTH = 48
# The agent name the fixed layout's line width is measured with (the scripted orchestrator's).
LAYOUT_AGENT = "s"
_ONE_HOP = re.compile(r"What is the [\w ]+? of the (\w+) that lies in (.+?) and dates from the (\d+s)\?")


def brief(question: str, width: int = BRIEF_WIDTH) -> str:
    """A one-hop question's brief form, right-justified to `width` characters: `<noun>: <region>,
    <decade>`. The region and the decade name one document (the corpus's clues are unique), and
    the decade comes last, as in the question, so a sub-agent's grep copies its digits from a
    fixed distance (the search demo's `fixed_offsets`)."""
    m = _ONE_HOP.fullmatch(question)
    if m is None:
        raise ValueError(
            "swarm layout 'fixed' needs one-hop questions 'What is the <attr> of the <noun> that lies in "
            f"<region> and dates from the <decade>s?', got {question!r}"
        )
    noun, region, decade = m.groups()
    text = f"{noun}: {region}, {decade}"
    if len(text) > width:
        raise ValueError(f"swarm layout 'fixed': the brief {text!r} is longer than {width} characters")
    return text.rjust(width)


def line_width(width: int = BRIEF_WIDTH) -> int:
    """The fixed layout's prompt line width (newline included): an assign_task call of a brief."""
    return len(call(ASSIGN, agent=LAYOUT_AGENT, prompt=" " * width))


class Item(msgspec.Struct, frozen=True, kw_only=True):
    """One item of a swarm task: a search task's question and the documents that answer it."""

    key: str
    question: str
    targets: list[str]
    queries: list[str]

    @classmethod
    def of(cls, t: SearchTask, layout: Layout = "lines") -> Item:
        question = t.question if layout == "lines" else brief(t.question)
        if layout == "brief":
            question = question.strip()
        return cls(key=t.key, question=question, targets=list(t.targets), queries=list(t.queries))


def prompt(items: list[Item], layout: Layout = "lines", mode: str = "swarm", agenda: bool = False) -> str:
    """The orchestrator's prompt: (single mode: `SINGLE_TAG`), the header, then one question per
    line (`fixed`: each line right-justified to the width of the assign_task call that carries it);
    with `agenda` (single mode by reference) then the first item as a sub-agent reads its own."""
    tag = SINGLE_TAG if mode == "single" else ""
    if layout == "fixed":
        width = line_width(max(len(it.question) for it in items))
        text = tag + HEADER + "".join(it.question.rjust(width - 1) + "\n" for it in items)
    else:
        text = tag + HEADER + "".join(f"{it.question}\n" for it in items)
    return text + agenda_line(items[0]) if agenda and items else text


def agenda_line(item: Item) -> str:
    """The single agent's next item (single mode by reference), worded as a sub-agent's whole prompt
    is (`question_prompt`), so the agent's search copies from the line it just read, as a sub-agent's does."""
    return question_prompt(item.question, tools_line=False)


def task_key(kind: str, items: list[Item]) -> str:
    """The canonical key: the kind and the items' keys (in prompt order)."""
    return f"{kind}:" + "+".join(it.key for it in items)


def split_of(key: str, heldout_one_in: int) -> str:
    digest = hashlib.blake2b(f"swarm:{key}".encode(), digest_size=8).digest()
    return "heldout" if int.from_bytes(digest, "little") % heldout_one_in == 0 else "train"


def document_split(doc_id: str, heldout_one_in: int) -> str:
    """A document's split under `heldout_items = "unseen"`: a hash of its id."""
    digest = hashlib.blake2b(f"swarm-doc:{doc_id}".encode(), digest_size=8).digest()
    return "heldout" if int.from_bytes(digest, "little") % heldout_one_in == 0 else "train"


def item_split(targets: Sequence[str], heldout_one_in: int) -> str | None:
    """An item's split under `unseen`: its documents' split when they agree, else None (unused)."""
    splits = {document_split(d, heldout_one_in) for d in targets}
    return splits.pop() if len(splits) == 1 else None


def item_keys(key: str) -> list[str]:
    """The item keys of a task key (`kind:key+key+...`)."""
    return key.partition(":")[2].split("+")


def items_of(metadata: dict[str, str]) -> list[Item]:
    """The items of a task, from its metadata."""
    return msgspec.json.decode(metadata["items"], type=list[Item])


def metadata_of(kind: str, items: list[Item]) -> dict[str, str]:
    return {
        "key": task_key(kind, items),
        "kind": kind,
        "n_items": str(len(items)),
        "items": msgspec.json.encode(items).decode(),
    }


def draw(
    rng: random.Random,
    pools: dict[str, list[SearchTask]],
    *,
    deep_rate: float,
    wide: tuple[int, int],
    branches: int,
    layout: Layout = "lines",
    counts: Sequence[int] = (),
) -> tuple[str, list[Item]]:
    """One task's kind and items (distinct items, in a random order); a wide task has one of
    `counts` items (uniformly), or wide[0]..wide[1] when `counts` is empty."""
    kind = "deep" if pools.get("deep") and rng.random() < deep_rate else "wide"
    n = branches if kind == "deep" else (rng.choice(list(counts)) if counts else rng.randint(*wide))
    pool = pools[kind]
    if len(pool) < n:
        raise ValueError(f"swarm: {kind} tasks need {n} items, the corpus has {len(pool)} of the right hops")
    return kind, [Item.of(t, layout) for t in rng.sample(pool, n)]


def required(items: list[Item]) -> list[str]:
    """Every document the final answer must hold, item by item, without repeats."""
    return list(dict.fromkeys(d for it in items for d in it.targets))


__all__ = [
    "AGENT_NAMES",
    "BRIEF_WIDTH",
    "HEADER",
    "SINGLE_TAG",
    "Item",
    "Layout",
    "agenda_line",
    "brief",
    "document_split",
    "draw",
    "item_keys",
    "item_split",
    "items_of",
    "line_width",
    "metadata_of",
    "prompt",
    "required",
    "split_of",
    "task_key",
]
