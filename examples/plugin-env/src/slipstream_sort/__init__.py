"""`sort`: write a word's letters in order ("sort cab=" -> "abc"); a Slipstream environment plugin."""

import random

import msgspec

from slipstream.envs import Environment, Problem, Score, TaskSpec


class SortOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    length: int = 3  # letters per word
    alphabet: str = "abcdefgh"  # letters are drawn from these

    def __post_init__(self) -> None:
        if not 1 <= self.length <= 16 or len(set(self.alphabet)) < 2 or not self.alphabet.isalpha():
            raise ValueError(f"need 1 <= length <= 16 and >= 2 distinct letters, got {self.length}, {self.alphabet!r}")


class Sort(Environment[SortOptions]):
    """Single-turn: the prompt is "sort <word>=", the answer its letters sorted, then a newline."""

    Options = SortOptions
    components = ("correct", "format")  # named reward parts; they sum to the reward

    @property
    def max_completion_chars(self) -> int:
        return self.options.length + 1  # the answer and its terminator "\n"

    def sample(self, rng: random.Random) -> Problem:
        # The key is the problem's identity: its hash decides the split (one key in 8 is held out).
        word = "".join(rng.choice(self.options.alphabet) for _ in range(self.options.length))
        return Problem(key=word, prompt=f"sort {word}=", reference="".join(sorted(word)))

    def grade(self, task: TaskSpec, completion: str) -> Score:
        answer = completion.partition(self.terminator)[0]
        if not answer:
            return self.failure("empty answer line")
        correct = answer == task.reference
        well_formed = len(answer) == self.options.length and set(answer) <= set(self.options.alphabet)
        return Score.of(
            {"correct": 1.0 if correct else 0.0, "format": 0.1 if well_formed else 0.0},
            correct=correct,
            parse_ok=True,
            reason="correct" if correct else f"expected {task.reference!r}, got {answer[:32]!r}",
        )
