"""The model's view of a search episode, the token budget's messages, and what a prune rewrites.

`View` mirrors the sample the model is continuing: its prompt, then each policy turn and each
observation, with their token positions in the current sample where known. A prune is a context
edit: `View.pruned(ids)` returns the pieces of a new sample (`ctx.branch`) in which every block of
a pruned chunk reads `[pruned: <id>]`. Everything before the first segment holding a pruned chunk
is copied verbatim (`Span`, the parent's ids); from there on the view is re-rendered as text (for
a byte-level tokenizer the same ids; the policy's earlier sampled ids are kept in the parent
sample, which trains as it was sampled). The full, unpruned log is the episode's tool log, never
rewritten: the reward reads it.

Budget messages (Context-1's harness, techniques.md §4.2): after every turn the usage line
`[Token usage: 14,203/32,768]` (the tokens of the sample the model continues, i.e. its context);
past half the budget, in training rollouts only, a suggestion to prune or conclude; past the hard
cutoff every tool but prune_chunks is refused with `refusal`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slipstream.envs.context import Span
from slipstream.envs.search.tools import chunk_blocks

SOFT_MESSAGE = "[Over half the budget: prune chunks, or give your final answer.]\n"


def usage_line(used: int, budget: int) -> str:
    """Exactly `[Token usage: 14,203/32,768]`, then a newline."""
    return f"[Token usage: {used:,}/{budget:,}]\n"


def refusal(tool: str, why: str) -> str:
    """The error a refused call gets: `why` is "past the hard cutoff" or "no room left"."""
    return f"error: {tool} refused, {why}: prune chunks or give your final answer"


def pruned_marker(chunk_id: str) -> str:
    return f"[pruned: {chunk_id}]"


@dataclass
class Segment:
    role: str  # "policy" or "observation"
    text: str
    start: int | None  # token position in the current sample; None inside a re-rendered tail


@dataclass
class View:
    """What the model currently sees, and which chunks are in it."""

    prompt_len: int
    segments: list[Segment] = field(default_factory=list)
    tail_start: int | None = None  # where the re-rendered text of the last prune begins

    def add(self, role: str, text: str, start: int) -> None:
        self.segments.append(Segment(role, text, start))

    def visible_chunks(self) -> list[str]:
        """Chunk ids whose blocks are in the view, in order."""
        return [cid for s in self.segments if s.role == "observation" for cid, _ in chunk_blocks(s.text)]

    def pruned(self, ids: set[str]) -> list[Span | str]:
        """The new sample's pieces with the blocks of `ids` replaced; updates the view to match."""
        first = next(
            (i for i, s in enumerate(self.segments) if s.role == "observation" and ids & _ids(s.text)),
            None,
        )
        if first is None:
            raise ValueError(f"none of {sorted(ids)} is in the view")
        seg = self.segments[first]
        if seg.start is None:
            # Inside the previous prune's re-rendered tail: re-render from that tail's start.
            assert self.tail_start is not None
            first = next(i for i, s in enumerate(self.segments) if s.start is None)
            keep = self.tail_start
        else:
            keep = seg.start
        for s in self.segments[first:]:
            if s.role == "observation":
                for cid, block in chunk_blocks(s.text):
                    if cid in ids:
                        s.text = s.text.replace(block, pruned_marker(cid), 1)
            s.start = None
        self.tail_start = keep
        return [Span(0, keep), "".join(s.text for s in self.segments[first:])]


def _ids(text: str) -> set[str]:
    return {cid for cid, _ in chunk_blocks(text)}
