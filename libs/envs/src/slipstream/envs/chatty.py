"""`chatty`: `arith` where verbosity is optional, the task Toggle's budget control is measured on.

The prompt and the verifier are `arith`'s ("3+5=" -> "8"): the answer is the leading integer of
the answer line, and text after it on the line is ignored. Unlike `arith`, `format_reward`
defaults to 0, so a padded right answer ("8, since that is the sum") scores exactly what a terse
one ("8") scores: the reward has no length preference of its own, and any fall in tokens per
correct answer is the training rule's doing (Toggle, slipstream.rl.toggle), not the score's.

The warm-start is what makes the policy verbose: `pad_rate` of the supervised examples (chosen
by a hash of the task id, so a run is reproducible and every problem key sees both forms) append
`filler` to the answer, so the warm-started model pads about that share of its answers.
`max_completion_chars` allows for the filler, so greedy held-out decoding is not cut short.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, ClassVar, cast

import msgspec

from slipstream.envs.arith import Arith, ArithOptions
from slipstream.envs.base import TaskSpec
from slipstream.envs.registry import register

Doc = msgspec.Meta

DEFAULT_FILLER = ", since that is the sum"


class ChattyOptions(ArithOptions, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Options of `chatty`: `arith`'s, with `format_reward` 0, plus the warm-start's padding."""

    format_reward: Annotated[
        float, Doc(description="Reward for an answer line that is the integer alone (0: padding costs nothing).")
    ] = 0.0
    pad_rate: Annotated[float, Doc(description="Share (0-1) of warm-start examples whose answer carries filler.")] = 0.5
    filler: Annotated[str, Doc(description="Text after the answer on padded warm-start examples (no newline).")] = (
        DEFAULT_FILLER
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.pad_rate <= 1.0:
            raise ValueError(f"pad_rate must be in [0, 1], got {self.pad_rate}")
        if "\n" in self.filler or not self.filler.isprintable():
            raise ValueError(f"filler must be printable text without a newline, got {self.filler!r}")
        if self.filler[:1].isdigit():
            raise ValueError(f"filler must not start with a digit (it would join the answer), got {self.filler!r}")


@register("chatty")
class Chatty(Arith):
    """Single-turn addition whose warm-start pads `pad_rate` of its answers with ignored filler."""

    version: ClassVar[str] = "1"
    Options: ClassVar[type[msgspec.Struct]] = ChattyOptions

    @property
    def chatty(self) -> ChattyOptions:
        """The options as `ChattyOptions` (the base class types them as `arith`'s)."""
        return cast(ChattyOptions, self.options)

    @property
    def max_completion_chars(self) -> int:
        return super().max_completion_chars + len(self.chatty.filler)

    def padded(self, task: TaskSpec) -> bool:
        """Whether `task`'s warm-start example carries the filler (a hash of its id below pad_rate)."""
        digest = hashlib.blake2b(f"chatty:{task.task_id}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") / 2**64 < self.chatty.pad_rate

    def sft_example(self, task: TaskSpec) -> str:
        filler = self.chatty.filler if self.padded(task) else ""
        return task.reference + filler + self.terminator
