"""`reasoning_gym`: any of reasoning-gym's procedural task generators, scored by its own verifier.

    [env]
    name = "reasoning_gym"
    options = { dataset = "chain_sum", config = { min_terms = 2, max_terms = 2, max_digits = 1 } }

`dataset` is a reasoning-gym dataset name (`reasoning_gym.factory.DATASETS`, 100+ of them) and
`config` its config class's fields (seed and size excepted: they are the environment's). Both are
checked when the options are parsed, so a wrong name or field fails as the run file loads.

Tasks. reasoning-gym makes item `i` of a dataset seeded `s` from `Random(s + i)`, so datasets
seeded s and s + 1 hold the same items shifted by one: different seeds alone are not different
items. `generate(split, n, seed)` therefore draws from datasets whose seeds are 62-bit hashes of
(dataset, split, seed, part), `size` items a part, so each call reads its own streams, and keeps an item only when its
question's key hashes into `split` (the base class's rule, one key in `heldout_one_in` held out):
a held-out question is never a training question, under any seed, even for a dataset whose
question space is small enough to repeat (chain_sum with one-digit terms has ~200 questions).
A task carries the dataset seed and index in its metadata (`rg_seed`, `rg_index`).

Scoring. The verifier regenerates the task's item from that seed and index (an item's answer can
need its metadata, which the wire task does not carry), checks it is the same question (a changed
reasoning-gym version or config would silently score another item: that is a failure score
naming it), and passes the answer line (the completion up to the terminator, stripped) to the
dataset's own `score_answer`. Its value in [0, 1] is the one reward component, `score`; `correct`
is a score of 1. reasoning-gym is imported only when this environment is first named: it is
registered through the `slipstream.environments` entry point of libs/envs (the plugin path), and
installed with libs/envs' `reasoning-gym` extra.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import random
from collections import OrderedDict
from typing import Annotated, Any, ClassVar

import msgspec
import reasoning_gym  # type: ignore[import-untyped]  # ships no type information
from reasoning_gym.factory import DATASETS  # type: ignore[import-untyped]

from slipstream.envs.base import SPLITS, Environment, Problem, Score, Split, TaskSpec
from slipstream.envs.registry import register

Doc = msgspec.Meta

_OWN_FIELDS = ("seed", "size")  # the environment sets these; a config may not
_CACHE = 64  # datasets kept per process: a reward model scores the tasks of a few seeds at a time
_DATASETS: OrderedDict[tuple[str, bytes, int, int], Any] = OrderedDict()


class ReasoningGymOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Options of `reasoning_gym`; `get_env("reasoning_gym", dataset="chain_sum", config={"max_terms": 2})`."""

    dataset: Annotated[str, Doc(description="A reasoning-gym dataset name (reasoning_gym.factory.DATASETS).")] = (
        "chain_sum"
    )
    config: Annotated[dict[str, Any], Doc(description="The dataset config's fields (not seed or size).")] = {}
    size: Annotated[int, Doc(description="Items per dataset stream; a few datasets precompute this many.")] = 10_000
    prompt_suffix: Annotated[str, Doc(description="Appended to the question: where the answer starts.")] = "\nAnswer: "
    max_answer_chars: Annotated[int, Doc(description="Longest answer line sampled (decoding bound).")] = 32

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"unknown reasoning-gym dataset {self.dataset!r}; known: {', '.join(sorted(DATASETS))}")
        fields = [f.name for f in dataclasses.fields(DATASETS[self.dataset][1]) if f.name not in _OWN_FIELDS]
        unknown = sorted(set(self.config) - set(fields))
        if unknown:
            raise ValueError(
                f"unknown config field(s) {', '.join(unknown)} for {self.dataset!r}; known: {', '.join(fields)}"
            )
        if not 1 <= self.size <= 20_000 or self.max_answer_chars < 1:
            raise ValueError(
                f"need 1 <= size <= 20000 and max_answer_chars >= 1, got {self.size}, {self.max_answer_chars}"
            )
        try:  # the dataset's own checks (ranges, orderings), on a throwaway instance
            _make(self.dataset, self.config, seed=0, size=1)
        except Exception as exc:
            raise ValueError(f"config {self.config} rejected by reasoning-gym's {self.dataset!r}: {exc!r}") from exc


def _make(dataset: str, config: dict[str, Any], *, seed: int, size: int) -> Any:
    return reasoning_gym.create_dataset(dataset, **config, seed=seed, size=size)


def _key(question: str) -> str:
    return "q:" + hashlib.blake2b(question.encode(), digest_size=8).hexdigest()


@register("reasoning_gym")
class ReasoningGym(Environment[ReasoningGymOptions]):
    """Single-turn: a reasoning-gym question, answered on one line, scored by `score_answer`."""

    version: ClassVar[str] = f"1+rg{importlib.metadata.version('reasoning-gym')}"
    Options: ClassVar[type[msgspec.Struct]] = ReasoningGymOptions
    components: ClassVar[tuple[str, ...]] = ("score",)

    @property
    def max_completion_chars(self) -> int:
        return self.options.max_answer_chars + len(self.terminator)

    def stream_seed(self, split: Split, seed: int, part: int = 0) -> int:
        """The dataset seed of part `part` of `generate(split, ..., seed)`'s items (`size` items a part):
        a hash, so no two calls (or parts) read overlapping items."""
        text = f"{self.name}|{self.options.dataset}|{split}|{seed}|{part}".encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2

    def dataset(self, seed: int) -> Any:
        """The reasoning-gym dataset of stream `seed`, kept per process: some read word lists as they are
        built (spell_backward: ~0.3 s), and the generator and the verifier ask for the same streams."""
        opts = self.options
        key = (opts.dataset, msgspec.json.encode(opts.config, order="sorted"), opts.size, seed)
        found = _DATASETS.get(key)
        if found is None:
            found = _DATASETS[key] = _make(opts.dataset, opts.config, seed=seed, size=opts.size)
            if len(_DATASETS) > _CACHE:
                _DATASETS.popitem(last=False)
        _DATASETS.move_to_end(key)
        return found

    def sample(self, rng: random.Random) -> Problem:
        entry = self.dataset(rng.getrandbits(62))[0]
        return Problem(key=_key(entry["question"]), prompt=self._prompt(entry), reference=str(entry["answer"]))

    def generate(self, split: Split, n: int, seed: int) -> list[TaskSpec]:
        """`n` tasks of `split` from this call's own stream, questions of the other split skipped."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        tasks: list[TaskSpec] = []
        max_draws, draws = 1000 + 64 * n, 0
        while len(tasks) < n:
            part, index = divmod(draws, self.options.size)
            if draws >= max_draws:
                raise ValueError(
                    f"{self.name}: drew {draws} items of {self.options.dataset!r} and found only {len(tasks)} of "
                    f"split {split!r}; its options leave too few {split} questions"
                )
            stream = self.stream_seed(split, seed, part)
            entry = self.dataset(stream)[index]
            draws += 1
            key = _key(entry["question"])
            if self.split_of(key) != split:
                continue
            tasks.append(
                TaskSpec(
                    task_id=f"{self.name}-{split}-{seed}-{len(tasks)}",
                    env=self.name,
                    prompt=self._prompt(entry),
                    reference=str(entry["answer"]),
                    seed=seed,
                    split=split,
                    metadata={"key": key, "rg_seed": str(stream), "rg_index": str(index)},
                )
            )
        return tasks

    def _prompt(self, entry: dict[str, Any]) -> str:
        return str(entry["question"]) + self.options.prompt_suffix

    def grade(self, task: TaskSpec, completion: str) -> Score:
        try:
            stream, index = int(task.metadata["rg_seed"]), int(task.metadata["rg_index"])
        except (KeyError, ValueError):
            return self.failure(f"task {task.task_id!r} carries no reasoning-gym seed and index (rg_seed, rg_index)")
        entry = self.dataset(stream)[index]
        if _key(entry["question"]) != task.metadata.get("key"):
            return self.failure(
                f"item {index} of stream {stream} is not the task's question: reasoning-gym "
                f"{importlib.metadata.version('reasoning-gym')} or the options differ from the task source's"
            )
        answer = completion.partition(self.terminator)[0].strip()
        if not answer:
            return self.failure("empty answer line")
        score = float(self.dataset(stream).score_answer(answer, entry))
        right = str(entry["answer"])
        reason = "correct" if score >= 1.0 else f"score {score:g}: expected {right[:32]!r}, got {answer[:32]!r}"
        return Score.of({"score": score}, correct=score >= 1.0, parse_ok=True, reason=reason)
