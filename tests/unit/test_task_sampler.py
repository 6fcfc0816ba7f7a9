"""The pass-rate sampler's rule (services/task-source sampler.py): weights by hand, the pool's life, seeded draws."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from slipstream.control import TaskStat
from slipstream.run import load, run_env
from slipstream.run.plan import TrainingPlan
from slipstream.runtime.section import ServiceSection
from slipstream.schemas import Task
from slipstream.task_source.config import TaskSourceConfig, TasksSection
from slipstream.task_source.sampler import PassRateSampler, informativeness, revisit_task, revisit_weight

G = 8


def sampler(**kw: float) -> PassRateSampler:
    args = {
        "group_size": G,
        "revisit_share": 1.0,
        "retire_above": 0.9,
        "never_weight": 0.05,
        "max_serves": 8,
        "pool_size": 100,
        "pending_timeout_s": 60.0,
        "seed": 0,
    }
    args.update(kw)
    return PassRateSampler(**args)  # type: ignore[arg-type]


def task(word: str) -> Task:
    return Task(task_id=f"r:reverse-train-0-{word}", env="reverse", prompt=f"rev {word}=", metadata={"key": word})


def stat(attempts: int, solved: int) -> TaskStat:
    return TaskStat(attempts=attempts, solved=solved, reward_sum=float(solved))


def test_informativeness_by_hand() -> None:
    assert informativeness(0.5, 8) == pytest.approx(1 - 2 / 256)  # 0.9921875
    # 1 - (1/8)^8 - (7/8)^8 = (16777216 - 1 - 5764801) / 16777216
    assert informativeness(1 / 8, 8) == pytest.approx(11012414 / 16777216)
    assert informativeness(0.0, 8) == 0.0 and informativeness(1.0, 8) == 0.0
    assert informativeness(0.5, 2) == pytest.approx(0.5)


def test_revisit_weight_rule() -> None:
    kw = {"group_size": G, "retire_above": 0.9, "never_weight": 0.05}
    assert revisit_weight(0, 0, **kw) is None  # no result yet
    assert revisit_weight(8, 8, **kw) == 0.0  # solved every time: retired (ScaleRL)
    assert revisit_weight(10, 9, **kw) == 0.0  # 0.9 >= retire_above
    assert revisit_weight(8, 0, **kw) == 0.05  # never solved: rarely
    assert revisit_weight(8, 4, **kw) == pytest.approx(0.9921875)
    assert revisit_weight(8, 7, **kw) == pytest.approx(11012414 / 16777216)  # p = 7/8 mirrors 1/8


def test_a_task_lives_from_fresh_to_retired() -> None:
    s = sampler()
    t = task("abc")
    assert s.remember(t, "reverse/abc", stat(0, 0), now=0.0)
    assert not s.remember(task("abc"), "reverse/abc", stat(0, 0), now=0.0)  # drawn twice: one entry
    assert s.waiting() == ["reverse/abc"] and s.choose(4) == []  # in flight: nothing to revisit
    s.update("reverse/abc", stat(0, 0), now=1.0)  # its group is not in yet
    assert s.waiting() == ["reverse/abc"]
    s.update("reverse/abc", stat(8, 3), now=2.0)  # 3 of 8 solved
    assert s.pool["reverse/abc"].weight == pytest.approx(informativeness(3 / 8, G))  # 0.859
    assert s.fresh_value == pytest.approx(2 / 3)  # one informative fresh group: (1 + 1) / (1 + 2)
    (entry,) = s.choose(4)  # the one ready entry, once
    again = s.served(entry, now=3.0)
    assert again.task_id == "r:reverse-train-0-abc~r2" and again.prompt == t.prompt and again.metadata == t.metadata
    assert s.waiting() == ["reverse/abc"]
    s.update("reverse/abc", stat(16, 11), now=4.0)  # the latest group: 8 of 8
    assert "reverse/abc" not in s.pool and s.left == {"retired": 1} and s.revisits == 1


def test_max_serves_lost_groups_and_the_pool_bound() -> None:
    s = sampler(max_serves=2, pool_size=2, pending_timeout_s=10.0)
    s.remember(task("abc"), "k1", stat(0, 0), now=0.0)
    s.update("k1", stat(8, 2), now=1.0)
    s.served(s.choose(1)[0], now=1.0)
    s.update("k1", stat(16, 4), now=2.0)  # served twice = max_serves: leaves with a result
    assert s.left == {"max_serves": 1}
    s.remember(task("abd"), "k2", stat(5, 1), now=0.0)  # base counts from earlier runs are subtracted
    s.update("k2", stat(5, 1), now=9.0)
    assert "k2" in s.pool
    s.update("k2", stat(5, 1), now=10.5)  # no result 10.5 s after it went out: stop waiting
    assert "k2" not in s.pool and s.left == {"max_serves": 1, "lost": 1}
    for i in range(3):
        s.remember(task(f"w{i}"), f"w{i}", stat(0, 0), now=0.0)
    assert list(s.pool) == ["w1", "w2"]  # the oldest is forgotten


def ready_pair(revisit_share: float) -> PassRateSampler:
    """Two mixed tasks, and six never solved: fresh value (2 + 1) / (8 + 2) = 0.3."""
    s = sampler(revisit_share=revisit_share, seed=7)
    s.remember(task("abc"), "half", stat(0, 0), now=0.0)
    s.remember(task("abd"), "eighth", stat(0, 0), now=0.0)
    s.update("half", stat(8, 4), now=1.0)  # weight 0.9921875
    s.update("eighth", stat(8, 1), now=1.0)  # weight 0.65639...
    for i in range(6):
        s.remember(task(f"n{i}"), f"never{i}", stat(0, 0), now=0.0)
        s.update(f"never{i}", stat(8, 0), now=1.0)  # weight 0.05, below a fresh task's 0.3
    assert s.fresh_value == pytest.approx(0.3)
    return s


def test_choices_follow_the_weights_and_the_revisit_share() -> None:
    n = 20_000
    s = ready_pair(1.0)
    picks = [s.choose(1)[0].key for _ in range(n)]  # choose leaves them ready (not served)
    p_half = 0.9921875 / (0.9921875 + 11012414 / 16777216)  # 0.60185...
    se = math.sqrt(p_half * (1 - p_half) / n)  # 0.0035
    assert abs(picks.count("half") / n - p_half) < 4 * se
    # Without replacement, and never a never-solved task while a fresh one is worth more: 2 of 5 slots.
    assert sorted(e.key for e in s.choose(5)) == ["eighth", "half"]
    s = ready_pair(0.25)
    revisits = sum(len(s.choose(1)) for _ in range(n))
    assert abs(revisits / n - 0.25) < 4 * math.sqrt(0.25 * 0.75 / n)
    assert len(ready_pair(0.0).choose(100)) == 0


def test_never_solved_tasks_come_back_only_when_fresh_ones_are_worth_less() -> None:
    s = sampler()
    for i in range(40):
        s.remember(task(f"n{i}"), f"never{i}", stat(0, 0), now=0.0)
        s.update(f"never{i}", stat(8, 0), now=1.0)
    assert s.fresh_value == pytest.approx(1 / 42)  # below never_weight 0.05: a never-solved task beats it
    assert len(s.choose(3)) == 3
    s = sampler()
    s.remember(task("abc"), "k", stat(0, 0), now=0.0)
    s.update("k", stat(8, 0), now=1.0)  # fresh value (0 + 1) / (1 + 2) = 0.333 > 0.05
    assert s.choose(3) == []
    assert s.status()["results"] == {"fresh": 1, "fresh_informative": 0, "revisit": 0, "revisit_informative": 0}


def test_the_same_seed_draws_the_same() -> None:
    a, b = ready_pair(0.5), ready_pair(0.5)
    assert [[e.key for e in a.choose(2)] for _ in range(50)] == [[e.key for e in b.choose(2)] for _ in range(50)]


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match=r"revisit_share must be in \[0, 1\], got 1.5"):
        sampler(revisit_share=1.5)
    with pytest.raises(ValueError, match=r"sampler_retire_above must be in \(0, 1\], got 0.0"):
        TasksSection(sampler_retire_above=0.0)
    with pytest.raises(ValueError, match=r"sampler = 'pass_rate' reads the task statistics in Redis"):
        TaskSourceConfig(tasks=TasksSection(sampler="pass_rate"))
    ok = TaskSourceConfig(tasks=TasksSection(sampler="pass_rate"), service=ServiceSection(redis_url="redis://x:1"))
    assert ok.tasks.sampler_revisit_share == 1.0 and ok.tasks.sampler_retire_above == 0.9


def test_revisit_task_keeps_the_problem() -> None:
    t = task("xyz")
    r = revisit_task(t, 3)
    assert r.task_id == t.task_id + "~r3" and r.reference == t.reference and r.env == t.env


def test_the_plan_and_run_file_carry_the_sampler(tmp_path: Path) -> None:
    assert "SLIPSTREAM_TASKS__SAMPLER" not in run_env(TrainingPlan())
    assert run_env(TrainingPlan(task_sampler="pass_rate"))["SLIPSTREAM_TASKS__SAMPLER"] == "pass_rate"
    path = tmp_path / "run.toml"
    path.write_text('[batch]\ntask_sampler = "pass_rate"\n')
    assert load(path).plan().task_sampler == "pass_rate"
    path.write_text('[batch]\ntask_sampler = "often"\n')
    with pytest.raises(ValueError, match="task_sampler"):
        load(path)


def test_the_summary_gives_the_trained_share_and_why_the_rest_dropped() -> None:
    from slipstream.bench.demo import trained_share
    from slipstream.run.progress import trained_line

    tr = {"scored": 13600, "trained": 3840, "dropped": {"uniform_group": 9648, "stale": 112}}
    line = trained_line(tr)
    assert line.startswith("0.282 (dropped as ")  # 3840 / 13600 = 0.2824
    assert "stale: sampled more than max_staleness versions behind" in line
    assert "uniform_group: every reward in its group equal, so GRPO's advantages are 0" in line
    assert trained_line({"scored": 64, "trained": 64, "dropped": {}}) == "1.000"
    assert trained_line({}) == "-"
    assert trained_share(tr) == 0.2824 and trained_share({}) == -1.0
