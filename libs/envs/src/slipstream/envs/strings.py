"""`reverse`: a string transform ("rev abc=" -> "cba"), the second demo task.

It needs a different skill from `arith` (copying in reverse order, no arithmetic facts), so a
run that mixes both shows whether one policy learns two tasks.

Scoring mirrors `arith` (components sum to the reward):
- `correct`: `correct_reward` (1.0) when the answer equals the reversed word exactly.
- `format`: `format_reward` (0.1) when the answer line is exactly one run of alphabet characters,
  right or wrong. A clean right answer scores 1.1, a right one with trailing text 1.0.

Parsing: the answer line is the completion up to the first terminator ("\\n"), the rest is
ignored; the answer is the leading run of alphabet characters. No such run (empty, leading space,
digits) is a parse failure: reward 0.0, `parse_ok=False`.

Difficulty knobs (`ReverseOptions`): `min_len`/`max_len` (2..4 by default; the length is drawn
uniformly, then each letter) and `alphabet` (26 lowercase letters; a smaller alphabet is easier).
"""

from __future__ import annotations

import random
import string
from typing import Annotated, ClassVar

import msgspec

from slipstream.envs.base import Environment, Problem, Score, TaskSpec
from slipstream.envs.registry import register

Doc = msgspec.Meta

_FORBIDDEN = "=\n"  # the prompt separator and the terminator cannot be letters


class ReverseOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Options of `reverse`; `get_env("reverse", max_len=6, alphabet="abc")`."""

    min_len: Annotated[int, Doc(description="Shortest word.")] = 2
    max_len: Annotated[int, Doc(description="Longest word.")] = 4
    alphabet: Annotated[str, Doc(description="Letters words are drawn from (distinct, printable, no spaces).")] = (
        string.ascii_lowercase
    )
    correct_reward: Annotated[float, Doc(description="Reward component for a right answer.")] = 1.0
    format_reward: Annotated[float, Doc(description="Reward component for a well-formed answer line.")] = 0.1

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len <= 64:
            raise ValueError(f"need 1 <= min_len <= max_len <= 64, got min_len={self.min_len}, max_len={self.max_len}")
        bad = [c for c in self.alphabet if c in _FORBIDDEN or c.isspace() or not c.isprintable()]
        if not self.alphabet or bad or len(set(self.alphabet)) != len(self.alphabet):
            raise ValueError(
                f"alphabet must be non-empty distinct printable characters without spaces, '=' or newlines, "
                f"got {self.alphabet!r}"
            )
        if not self.correct_reward > self.format_reward >= 0.0:
            raise ValueError(
                f"need correct_reward > format_reward >= 0, got {self.correct_reward} and {self.format_reward}"
            )


@register("reverse")
class Reverse(Environment[ReverseOptions]):
    """Single-turn: "rev <word>=", answer the word reversed."""

    version: ClassVar[str] = "1"
    Options: ClassVar[type[msgspec.Struct]] = ReverseOptions
    components: ClassVar[tuple[str, ...]] = ("correct", "format")

    @property
    def max_completion_chars(self) -> int:
        return self.options.max_len + len(self.terminator)

    def sample(self, rng: random.Random) -> Problem:
        length = rng.randint(self.options.min_len, self.options.max_len)
        word = "".join(rng.choice(self.options.alphabet) for _ in range(length))
        return Problem(key=word, prompt=f"rev {word}=", reference=word[::-1])

    def grade(self, task: TaskSpec, completion: str) -> Score:
        if not completion:
            return self.failure("empty completion")
        line = completion.partition(self.terminator)[0]
        letters = set(self.options.alphabet)
        end = 0
        while end < len(line) and line[end] in letters:
            end += 1
        if end == 0:
            return self.failure(f"no alphabet characters at the start of the answer line {line[:32]!r}")
        answer = line[:end]
        correct = answer == task.reference
        reasons = ["correct" if correct else f"wrong: expected {task.reference!r}, got {answer[:32]!r}"]
        if end != len(line):
            reasons.append(f"trailing text {line[end : end + 32]!r} after the answer")
        return Score.of(
            {
                "correct": self.options.correct_reward if correct else 0.0,
                "format": self.options.format_reward if end == len(line) else 0.0,
            },
            correct=correct,
            parse_ok=True,
            reason="; ".join(reasons),
        )
