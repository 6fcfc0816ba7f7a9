"""`arith`: small-number arithmetic, the default demo task ("3+5=" -> "8").

Prompts are a few bytes so a tiny byte-level model learns them on a CPU in minutes.

Scoring (components sum to the reward):
- `correct`: `correct_reward` (1.0) when the answer equals the reference as an integer ("08" == 8).
- `format`: `format_reward` (0.1) when the answer line is exactly one canonical integer ("8",
  "-3"; not "08", "-0" or "8 apples"), right or wrong, so well-formed output is learned first.
So a clean right answer scores 1.1, a right answer with trailing text 1.0, a clean wrong one 0.1.

Parsing: the answer line is the completion up to the first terminator ("\\n"); what follows it is
ignored (a worker that decodes past the stop string is not penalised). The answer is the leading
`-?[0-9]+` of that line; nothing there (empty, leading space, garbage) is a parse failure: reward
0.0, `parse_ok=False`. Text after the answer on the same line keeps the answer but loses `format`.

Difficulty knobs (`ArithOptions`): `max_operand` sets the key space ((max_operand+1)^2 per op,
about one in eight held out) and the answer length; `ops` adds subtraction, whose negative results
need the "-" sign and learn about half as fast. Defaults: `max_operand=19`, `ops="+"`. At 9 a tiny
model memorises the 90 training problems within seconds (99.5% accuracy) while held-out accuracy
stays at 12% (10 problems it never sees), leaving RL and the eval gate nothing to improve. 19
costs no more bytes per prompt or answer, starts well below 100%, and its held-out accuracy rises
with training accuracy (measured figures in libs/envs/README.md).
"""

from __future__ import annotations

import random
import re
from typing import Annotated, ClassVar

import msgspec

from slipstream.envs.base import Environment, Problem, Score, TaskSpec
from slipstream.envs.registry import register

Doc = msgspec.Meta

_INTEGER = re.compile(r"-?[0-9]+")
_OPS = "+-"


class ArithOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Options of `arith`; `get_env("arith", max_operand=19, ops="+-")`."""

    max_operand: Annotated[int, Doc(description="Operands are drawn uniformly from 0..max_operand.")] = 19
    ops: Annotated[str, Doc(description="Operators to draw from: a non-empty subset of '+-'.")] = "+"
    correct_reward: Annotated[float, Doc(description="Reward component for a right answer.")] = 1.0
    format_reward: Annotated[float, Doc(description="Reward component for a well-formed answer line.")] = 0.1

    def __post_init__(self) -> None:
        if not 0 <= self.max_operand <= 1_000_000:
            raise ValueError(f"max_operand must be in 0..1000000, got {self.max_operand}")
        if not self.ops or set(self.ops) - set(_OPS) or len(set(self.ops)) != len(self.ops):
            raise ValueError(f"ops must be a non-empty subset of {_OPS!r} without repeats, got {self.ops!r}")
        if not self.correct_reward > self.format_reward >= 0.0:
            raise ValueError(
                f"need correct_reward > format_reward >= 0, got {self.correct_reward} and {self.format_reward}"
            )


def canonical_integer(text: str) -> str:
    """The canonical spelling of an integer literal: no leading zeros, no "-0" (no int() size limit)."""
    negative = text.startswith("-")
    digits = text.lstrip("-").lstrip("0") or "0"
    return "-" + digits if negative and digits != "0" else digits


@register("arith")
class Arith(Environment[ArithOptions]):
    """Single-turn: "a+b=" or "a-b=", answer the integer result."""

    version: ClassVar[str] = "1"
    Options: ClassVar[type[msgspec.Struct]] = ArithOptions
    components: ClassVar[tuple[str, ...]] = ("correct", "format")

    @property
    def max_completion_chars(self) -> int:
        longest = max(len(str(2 * self.options.max_operand)), len(str(-self.options.max_operand)))
        return longest + len(self.terminator)

    def sample(self, rng: random.Random) -> Problem:
        a = rng.randint(0, self.options.max_operand)
        op = rng.choice(self.options.ops)
        b = rng.randint(0, self.options.max_operand)
        key = f"{a}{op}{b}"
        return Problem(key=key, prompt=f"{key}=", reference=str(a + b if op == "+" else a - b))

    def grade(self, task: TaskSpec, completion: str) -> Score:
        if not _INTEGER.fullmatch(task.reference):
            return self.failure(f"reference {task.reference!r} of task {task.task_id!r} is not an integer")
        if not completion:
            return self.failure("empty completion")
        line = completion.partition(self.terminator)[0]
        match = _INTEGER.match(line)
        if match is None:
            return self.failure(f"no integer at the start of the answer line {line[:32]!r}")
        answer = match.group()
        canonical = canonical_integer(answer)
        correct = canonical == canonical_integer(task.reference)
        well_formed = answer == canonical and match.end() == len(line)
        reasons = ["correct" if correct else f"wrong: expected {task.reference}, got {canonical[:32]}"]
        if match.end() != len(line):
            reasons.append(f"trailing text {line[match.end() : match.end() + 32]!r} after the answer")
        elif answer != canonical:
            reasons.append(f"non-canonical integer {answer[:32]!r}")
        return Score.of(
            {
                "correct": self.options.correct_reward if correct else 0.0,
                "format": self.options.format_reward if well_formed else 0.0,
            },
            correct=correct,
            parse_ok=True,
            reason="; ".join(reasons),
        )
