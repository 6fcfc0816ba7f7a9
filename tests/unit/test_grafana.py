"""deploy/grafana/slipstream.json: a well-formed dashboard whose every query names a series the code registers.

Registered names are read from the source (every `counter("...")`, `gauge("...")` and
`histogram("...")` under libs/, services/ and tools/), turned into their Prometheus series
(`a/b/c` -> `a_b_c_total` for a counter, `_bucket`/`_sum`/`_count` for a histogram), and every
metric a panel queries must be one of them: a renamed metric breaks this test, not the dashboard.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from slipstream.stack.spec import SERVICES
from slipstream.telemetry.metrics import prom_name

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "slipstream.json"
_REGISTERED = re.compile(r"\b(counter|gauge|histogram)\(\s*(f?)\"([^\"]+)\"")
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless"}


def registered_series() -> set[str]:
    """Every Prometheus series name some code in the repository registers."""
    out: set[str] = set()
    for top in ("libs", "services", "tools"):
        for path in (REPO / top).glob("*/src/**/*.py"):
            for kind, is_f, name in _REGISTERED.findall(path.read_text()):
                names = [re.sub(r"\{[^}]*\}", s, name) for s in SERVICES] if is_f else [name]
                out.update(prom_name(n) + sfx for n in names for sfx in _SUFFIXES[kind])
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords and labels left out)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # range selectors
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*", s):
        if m.group() in _KEYWORDS or s[m.end() :].lstrip().startswith("("):
            continue  # a keyword or a function call
        names.add(m.group())
    return names


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def queries(dash: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(dash) for t in p.get("targets", [])]


@pytest.fixture(scope="module")
def dash() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def test_every_queried_metric_is_registered_by_some_code(dash: dict[str, Any]) -> None:
    known = registered_series()
    used = set().union(*(metric_names(e) for e in queries(dash)))
    assert len(used) >= 30, sorted(used)
    assert used - known == set(), f"the dashboard queries series no code registers: {sorted(used - known)}"


def test_the_dashboard_covers_what_the_issue_asks_for(dash: dict[str, Any]) -> None:
    used = set().union(*(metric_names(e) for e in queries(dash)))
    wanted = {
        "worker_engine_tokens_per_s",  # tokens/s
        "worker_tasks_inflight",  # requests in flight
        "bus_dlq_messages_total",  # DLQ count
        "learner_step_staleness_bucket",  # staleness histogram
        "reward_score_reward_sum",  # reward
        "reward_score_correct_total",  # accuracy
        "learner_step_time_s",  # step time
        "weights_publish_bytes_total",  # delta bytes
        "worker_weights_fetch_s_bucket",  # weight-sync time
        "worker_weights_pause_ms_bucket",  # in-flight pause
        "worker_weights_time_to_policy_s_bucket",  # time-to-policy
    }
    assert wanted - used == set()


def test_the_dashboard_is_well_formed(dash: dict[str, Any]) -> None:
    assert (dash["uid"], dash["title"]) == ("slipstream-overview", "Slipstream")
    (var,) = dash["templating"]["list"]
    assert (var["name"], var["type"], var["query"]) == ("datasource", "datasource", "prometheus")
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in panels(dash):
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["w"] > 0 and g["h"] > 0, p["title"]
        mine = {(g["x"] + dx, g["y"] + dy) for dx in range(g["w"]) for dy in range(g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        targets = p.get("targets", [])
        if p["type"] == "timeseries":
            assert targets, p["title"]
            assert p["datasource"]["uid"] == "${datasource}"
        assert len({t["refId"] for t in targets}) == len(targets), p["title"]


def test_the_query_reader_finds_metrics_and_the_check_catches_an_unknown_one() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (le) (rate(worker_weights_fetch_s_bucket{pod=~"w.*"}[$__rate_interval])))'
        " / ignoring(pod) max without (env) (learner_step_time_s offset 5m) > bool 0"
    )
    assert metric_names(expr) == {"worker_weights_fetch_s_bucket", "learner_step_time_s"}
    known = registered_series()
    assert {"bus_publish_messages_total", "learner_step_staleness_count", "reward_model_runtime_state"} <= known
    assert metric_names("rate(learner_step_time_s_total[1m]) + nonexistent_series") - known == {
        "learner_step_time_s_total",  # a gauge has no _total
        "nonexistent_series",
    }
