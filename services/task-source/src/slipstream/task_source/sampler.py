"""The pass-rate sampler: serve again the tasks whose groups carried a GRPO signal, never those solved every time.

A group whose rewards are all equal gives GRPO no advantage, and the learner drops it as
`uniform_group`. On the default demo (3-letter `reverse` words from a seeded space of ~15,400
train words) 66-71% of the trajectories were dropped that way: the chance that a fresh task's
group is informative is low, and a fresh word rarely comes back (~1,400-1,600 tasks drawn from
~15,400 words), so a statistic per fresh task is almost never read again and the difficulty
filter (`difficulty.py`) almost never fires.

What does recur is what the source serves again on purpose. The sampler keeps a pool of the tasks
it published, keyed by the statistics key (`<env>/<problem key>`: the word), and reads their
per-task statistics (`slipstream.control.TaskStats`, written by the learner for every trained
attempt and every dropped uniform group). The statistic a task is judged by is the pass rate of
its **latest group**: the change of its Redis counts since it was last served (the counts are
recorded per group in one transaction, so a change means the whole group is in). The latest group
rather than the running total because the policy moves: a word half-solved 30 steps ago says little
about now. From that pass rate p, with groups of G samples:

- p >= `retire_above` (ScaleRL's rule: a prompt solved every time is dropped for good): retired;
- p == 0 (never solved): weight `never_weight` (revisited rarely; it may become solvable);
- otherwise: weight 1 - p^G - (1-p)^G, the chance that a group of G is not uniform if p holds.

A revisit must beat a fresh task: the value of a fresh task is the share of informative groups
(0 < solved < attempts) among the last `FRESH_WINDOW` fresh tasks' first groups, (k + 1) / (n + 2).
Each task to publish is, with probability `revisit_share`, a revisit drawn with probability
proportional to its weight (without replacement) among the known tasks with no group in flight
whose weight exceeds that value; when there is none, or otherwise, it is a fresh task from the
generator, which keeps the run exploring and fills the pool. So a never-solved task (0.05) is
revisited only while fresh tasks are informative less often than that: rarely. (A first version
revisited any known task at 75% of slots, never-solved ones included: on the demo's seed 0 the
trained share rose only from 0.305 to 0.351.) With the rule above the demo's trained share rose
from 0.305-0.343 to 0.410-0.541 on seeds 0-2, with held-out accuracy rising less: off by default
(services/task-source README, "Fewer wasted rollouts"). A task is served at
most `max_serves` times (a bound on memorising one word), and a group whose result never comes
(dropped as stale, incomplete) stops being waited for after `pending_timeout_s`.

The rule (`revisit_weight`, `PassRateSampler`) is pure and seeded; `service.py` reads Redis.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import msgspec

from slipstream.control import TaskStat
from slipstream.schemas import Task

RETIRED = "retired"
"""Why a task left the pool: its latest group was solved (at or above retire_above) every time..."""
MAX_SERVES = "max_serves"
"""... it was served max_serves times ..."""
LOST = "lost"
"""... or its group's result never came (pending_timeout_s)."""


def informativeness(p: float, group_size: int) -> float:
    """The chance that a group of `group_size` samples is not uniform when each is solved with chance `p`."""
    return 1.0 - p**group_size - (1.0 - p) ** group_size


def revisit_weight(
    attempts: int, solved: int, *, group_size: int, retire_above: float, never_weight: float
) -> float | None:
    """The weight of serving a task again, from its latest group's attempts and solves.

    None: no result yet. 0.0: retire it (pass rate >= retire_above). `never_weight` when it was
    never solved. Else the chance its next group is informative, 1 - p^G - (1-p)^G.
    """
    if attempts <= 0:
        return None
    p = solved / attempts
    if p >= retire_above:
        return 0.0
    if solved == 0:
        return never_weight
    return informativeness(p, group_size)


@dataclass
class Entry:
    """One known task: what to serve again, the counts when it was last served, and its weight."""

    task: Task
    key: str
    base: TaskStat
    """Its statistics when last served: the latest group is the change since."""
    serves: int = 1
    served_at: float = 0.0
    weight: float | None = None
    """None while its latest group is in flight."""
    last_rate: float = -1.0


FRESH_WINDOW = 256
"""Fresh tasks' first groups over which a fresh task's value is measured (the policy moves)."""


class PassRateSampler:
    """The pool of served tasks and the rule that picks which to serve again. No I/O."""

    def __init__(
        self,
        *,
        group_size: int,
        revisit_share: float,
        retire_above: float,
        never_weight: float,
        max_serves: int,
        pool_size: int,
        pending_timeout_s: float,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= revisit_share <= 1.0:
            raise ValueError(f"revisit_share must be in [0, 1], got {revisit_share}")
        if not 0.0 < retire_above <= 1.0:
            raise ValueError(f"retire_above must be in (0, 1], got {retire_above}")
        if not 0.0 <= never_weight <= 1.0:
            raise ValueError(f"never_weight must be in [0, 1], got {never_weight}")
        if max_serves < 1 or pool_size < 1 or group_size < 1:
            raise ValueError(
                f"need max_serves, pool_size and group_size >= 1, got {max_serves}, {pool_size}, {group_size}"
            )
        if pending_timeout_s <= 0:
            raise ValueError(f"pending_timeout_s must be > 0, got {pending_timeout_s}")
        self.group_size = group_size
        self.revisit_share = revisit_share
        self.retire_above = retire_above
        self.never_weight = never_weight
        self.max_serves = max_serves
        self.pool_size = pool_size
        self.pending_timeout_s = pending_timeout_s
        self.rng = random.Random(f"task-sampler|{seed}")
        self.pool: dict[str, Entry] = {}  # insertion order = age: the oldest are evicted first
        self.revisits = 0
        self.left: dict[str, int] = {}
        self._fresh: deque[bool] = deque(maxlen=FRESH_WINDOW)  # was a fresh task's first group informative
        self.results = {"fresh": 0, "fresh_informative": 0, "revisit": 0, "revisit_informative": 0}

    @property
    def fresh_value(self) -> float:
        """The chance a fresh task's group is informative, as measured lately: (informative + 1) / (results + 2).

        The +1 / +2 (a uniform prior) keeps a handful of early results from setting it to 0 or 1.
        """
        return (sum(self._fresh) + 1) / (len(self._fresh) + 2)

    def remember(self, task: Task, key: str, base: TaskStat, now: float) -> bool:
        """A fresh task goes out with statistics `base` (read just before): keep it, to judge by its group.

        False when its key is in the pool already (a word drawn twice): the entry there judges it.
        """
        if key in self.pool:
            return False
        while len(self.pool) >= self.pool_size:
            del self.pool[next(iter(self.pool))]
        self.pool[key] = Entry(task=task, key=key, base=base, served_at=now)
        return True

    def waiting(self) -> list[str]:
        """Keys whose statistics to read: those with a group in flight."""
        return [k for k, e in self.pool.items() if e.weight is None]

    def update(self, key: str, stat: TaskStat, now: float) -> None:
        """Take the statistics read for `key`: its latest group's result, once it is in."""
        e = self.pool.get(key)
        if e is None or e.weight is not None:
            return
        attempts, solved = stat.attempts - e.base.attempts, stat.solved - e.base.solved
        w = revisit_weight(
            attempts,
            solved,
            group_size=self.group_size,
            retire_above=self.retire_above,
            never_weight=self.never_weight,
        )
        if w is None:
            if now - e.served_at > self.pending_timeout_s:
                self._leave(key, LOST)
            return
        informative = 0 < solved < attempts
        kind = "fresh" if e.serves == 1 else "revisit"
        self.results[kind] += 1
        self.results[f"{kind}_informative"] += informative
        if kind == "fresh":
            self._fresh.append(informative)
        e.base, e.weight, e.last_rate = stat, w, solved / attempts
        if w == 0.0:
            self._leave(key, RETIRED)
        elif e.serves >= self.max_serves:
            self._leave(key, MAX_SERVES)

    def choose(self, n: int) -> list[Entry]:
        """Of `n` tasks to publish, the known ones to serve again (the rest are fresh); marks them in flight.

        Each slot is a revisit with probability revisit_share, then one entry drawn with probability
        proportional to its weight among those not yet drawn whose weight beats a fresh task's value;
        a slot with no such entry left is fresh.
        """
        out: list[Entry] = []
        floor = self.fresh_value
        ready = [e for e in self.pool.values() if e.weight and e.weight > floor]
        for _ in range(n):
            if not ready or self.rng.random() >= self.revisit_share:
                continue
            pick = self.rng.choices(range(len(ready)), weights=[e.weight or 0.0 for e in ready])[0]
            out.append(ready.pop(pick))
        return out

    def served(self, entry: Entry, now: float) -> Task:
        """`entry` goes out again: its task under a new id (the stream dedups ids), its group now in flight."""
        entry.serves += 1
        entry.weight = None
        entry.served_at = now
        self.revisits += 1
        return revisit_task(entry.task, entry.serves)

    def _leave(self, key: str, why: str) -> None:
        del self.pool[key]
        self.left[why] = self.left.get(why, 0) + 1

    def status(self) -> dict[str, object]:
        return {
            "pool": len(self.pool),
            "ready": sum(1 for e in self.pool.values() if e.weight),
            "revisits": self.revisits,
            "left": dict(self.left),
            "fresh_value": round(self.fresh_value, 4),
            "results": dict(self.results),
        }


def revisit_task(task: Task, serves: int) -> Task:
    """The task's `serves`-th serving: the same problem (same statistics key) under id `<id>~r<serves>`."""
    return msgspec.structs.replace(task, task_id=f"{task.task_id}~r{serves}")
