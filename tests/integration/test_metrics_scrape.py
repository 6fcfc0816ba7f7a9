"""/metrics of every service, scraped from a running stack, and the same registry pushed over OTLP/HTTP.

One stack (nats-server, redis-server and the six services as processes) serves the module. Each
service must expose the runtime and bus series, the series the observability issue names for it
(tokens/s, tasks in flight, staleness, reward, step time, delta bytes, weight-sync time, pause,
time-to-policy ...), and every series its own source code registers. The OTLP test points the
exporter at a local HTTP receiver and decodes what arrives.
"""

from __future__ import annotations

import http.client
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from stack_spec import full_stack_spec

from slipstream.stack.local import Stack
from slipstream.stack.spec import SERVICES
from slipstream.telemetry.config import TelemetryConfig
from slipstream.telemetry.exposition import Exposition, parse_prometheus
from slipstream.telemetry.metrics import REGISTRY, prom_name
from slipstream.telemetry.metrics_export import setup_metrics, shutdown_metrics

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

# What the issue asks each service to expose, by the names the code gives them.
NAMED: dict[str, set[str]] = {
    "rollout-worker": {
        "worker_engine_tokens_per_s",  # tokens/s
        "worker_tasks_inflight",  # requests in flight
        "worker_weights_fetch_s",  # weight-sync time
        "worker_weights_pause_ms",  # in-flight pause
        "worker_weights_time_to_policy_s",  # time-to-policy
        "worker_weights_applied_version",
        "worker_trajectories_published",
    },
    "reward-model": {
        "reward_score_reward",
        "reward_score_scored",
        "reward_score_correct",
        "reward_score_dead_lettered",
    },
    "learner": {
        "learner_step_time_s",  # step time
        "learner_step_staleness",  # staleness histogram
        "learner_step_reward_mean",  # reward
        "learner_step_policy_version",
        "learner_intake_dropped",
    },
    "weight-publisher": {
        "weights_publish_bytes",  # delta bytes (label kind=keyframe|delta)
        "publisher_publish_seconds",
        "publisher_publish_latest_version",
    },
    "task-source": {"tasks_source_published", "tasks_source_outstanding", "tasks_source_window"},
    "eval-gate": set(),
}
BUS = {"bus_publish_messages", "bus_consume_messages", "bus_dlq_messages", "bus_consume_errors"}
_REGISTERED = re.compile(r"\b(counter|gauge|histogram)\(\s*(f?)\"([^\"]+)\"")


def runtime_series(service: str) -> set[str]:
    base = prom_name(service)
    return {f"{base}_runtime_state", f"{base}_runtime_uptime_s", f"{base}_http_requests"}


def registered_in(src: Path, service: str) -> set[str]:
    """Prometheus family names of every metric registered by a literal name under `src`."""
    out = set()
    for path in src.rglob("*.py"):
        for _kind, is_f, name in _REGISTERED.findall(path.read_text()):
            if is_f:
                name = re.sub(r"\{[^}]*\}", service, name)  # f"{service.name}/runtime/state"
            out.add(prom_name(name))
    return out


def scrape(url: str, path: str = "/metrics") -> tuple[int, str]:
    host, _, port = url.removeprefix("http://").partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(full_stack_spec(tmp_path_factory.mktemp("scrape"))) as st:
        st.wait_ready(240)
        yield st


def metrics_of(stack: Stack, name: str) -> Exposition:
    status, body = scrape(stack.services[name].url)
    assert status == 200, f"{name} /metrics answered {status}"
    return parse_prometheus(body)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("service", SERVICES)
def test_each_service_serves_its_named_series(stack: Stack, service: str) -> None:
    exp = metrics_of(stack, service)
    families = exp.families()
    expected = runtime_series(service) | BUS | NAMED[service]
    assert expected <= families, f"{service} lacks {sorted(expected - families)}"
    own = registered_in(REPO / "services" / service / "src", service)
    assert own, f"no metric registration found under services/{service}/src"
    assert own - families == set(), f"{service} registers but does not serve {sorted(own - families)}"
    base = prom_name(service)
    states = {s.labels["state"]: s.value for s in exp.select(f"{base}_runtime_state")}
    assert states["running"] == 1.0 and sum(states.values()) == 1.0, states
    assert (exp.value(f"{base}_runtime_uptime_s") or 0.0) > 0.0
    # The stack's readiness probes went through this server before any scrape.
    assert exp.total(f"{base}_http_requests_total", path="/readyz", code="200") >= 1


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_counters_move_while_the_pipeline_runs(stack: Stack) -> None:
    # The default config runs the pipeline: tasks go out, trajectories come back scored.
    deadline = time.monotonic() + 90
    published = scored = 0.0
    while time.monotonic() < deadline:
        published = metrics_of(stack, "task-source").total("tasks_source_published_total")
        scored = metrics_of(stack, "reward-model").total("reward_score_scored_total")
        if published > 0 and scored > 0:
            break
        time.sleep(1.0)
    assert published > 0 and scored > 0, (published, scored)
    worker = metrics_of(stack, "rollout-worker")
    trajectories = worker.total("worker_trajectories_published_total")
    assert trajectories > 0
    # The bus adds up its publish acks and moves its counters every 0.2 s at most (cheap on the
    # hot path), so a later scrape covers at least every trajectory acked before this one.
    time.sleep(1.0)
    assert metrics_of(stack, "rollout-worker").total("bus_publish_messages_total") >= trajectories
    _buckets, seconds, rollouts = worker.histogram("worker_tasks_rollout_s")
    assert rollouts > 0 and seconds > 0


class _Receiver(BaseHTTPRequestHandler):
    bodies: ClassVar[list[tuple[str, bytes]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Receiver.bodies.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()
        self.wfile.write(b"")

    def log_message(self, *args: object) -> None:
        pass


def test_the_registry_is_pushed_over_otlp_when_an_endpoint_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    server = HTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Receiver.bodies.clear()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    REGISTRY.counter("scrape-test/otlp/events", "Events of the OTLP test.").add(7, kind="a")
    try:
        pusher = setup_metrics("scrape-test", TelemetryConfig(metrics_interval_s=0.2), replica="r-1")
        assert pusher is not None
        deadline = time.monotonic() + 10
        while not _Receiver.bodies and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        shutdown_metrics()
        server.shutdown()
        server.server_close()
    assert _Receiver.bodies, "nothing reached the OTLP endpoint"
    path, body = _Receiver.bodies[-1]
    assert path == "/v1/metrics"
    request = ExportMetricsServiceRequest.FromString(body)
    (rm,) = request.resource_metrics
    resource = {kv.key: kv.value.string_value for kv in rm.resource.attributes}
    assert resource["service.instance.id"] == "r-1"
    metrics = {m.name: m for sm in rm.scope_metrics for m in sm.metrics}
    (point,) = metrics["scrape-test/otlp/events"].sum.data_points
    assert point.as_int == 7 and metrics["scrape-test/otlp/events"].sum.is_monotonic
    assert {kv.key: kv.value.string_value for kv in point.attributes} == {"kind": "a"}
