"""W3C trace context on NATS headers: injected on every publish, extracted on every delivery.

Context always travels (so a trace can follow a task through the services), but spans are only
opened when a real tracer provider is installed: with the API's default proxy provider a span per
message would cost microseconds for nothing.

Spans follow the OpenTelemetry messaging conventions: a PRODUCER span per publish (its context is
what the headers carry), a CONSUMER span per handled delivery, child of the producer's, and for
work that uses many messages at once (a learner step) a span with one link per message.
Consumer spans also carry the ids that matter to a reader of the trace (run, task, trajectory,
group, policy version, worker) when the message has them, as `slipstream.<field>`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

from opentelemetry import propagate, trace
from opentelemetry.context import Context, get_current
from opentelemetry.trace import Link, NoOpTracerProvider, ProxyTracerProvider, SpanKind

_TRACER_NAME = "slipstream.bus"
MSG_ID_HEADER = "Nats-Msg-Id"
# Fields copied onto consumer spans when the message (or the trajectory / episode it wraps) has them.
ID_FIELDS = ("run_id", "task_id", "trajectory_id", "episode_id", "group_id", "policy_version", "worker_id", "env")
AttributeValue = str | int | float | bool


class Traced(Protocol):
    """What tracing reads of a received message (a `delivery.Delivery` is one).

    Declared here rather than importing `Delivery`, since a delivery extracts its trace context
    with this module's `extract`: the two would otherwise import each other.
    """

    @property
    def subject(self) -> str: ...

    @property
    def headers(self) -> dict[str, str]: ...

    @property
    def msg(self) -> object: ...

    @property
    def num_delivered(self) -> int: ...

    @property
    def stream_seq(self) -> int: ...

    @property
    def context(self) -> Context: ...


def _provider_installed() -> bool:
    return not isinstance(trace.get_tracer_provider(), ProxyTracerProvider | NoOpTracerProvider)


def tracing_active() -> bool:
    """True once the process installed an SDK tracer provider (telemetry setup does it).

    Called per message, so it reads the API's global first: `get_tracer_provider()` looks up
    an environment variable on every call while none is set (several microseconds).
    """
    if getattr(trace, "_TRACER_PROVIDER", None) is None and hasattr(trace, "_TRACER_PROVIDER"):
        return False
    return _provider_installed()


def inject(headers: dict[str, str]) -> None:
    """Add traceparent/tracestate/baggage for the current context to `headers`.

    An empty context (no span, no baggage) has nothing to propagate; skipping the propagators
    then saves ~7 µs per message.
    """
    ctx = get_current()
    if ctx:
        propagate.inject(headers, context=ctx)


def extract(headers: dict[str, str] | None) -> Context:
    return propagate.extract(headers or {})


@contextmanager
def producer_span(subject: str) -> Iterator[Any]:
    """A PRODUCER span around one publish when tracing is on; nothing otherwise."""
    if not tracing_active():
        yield None
        return
    tracer = trace.get_tracer(_TRACER_NAME)
    with tracer.start_as_current_span(
        f"publish {subject}",
        kind=SpanKind.PRODUCER,
        attributes={"messaging.system": "nats", "messaging.destination.name": subject},
    ) as span:
        yield span


@contextmanager
def service_span(
    name: str,
    attributes: Mapping[str, AttributeValue] | None = None,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    parent: Context | None = None,
    root: bool = False,
) -> Iterator[Any]:
    """A span around a service's own step (a task publish, a weight publication) when tracing is on.

    Its parent is `parent` when given (a context carried out of band: a delivery's, or one read
    from a staged file's metadata), else a new trace with `root`, else the current span. Yields
    None, and makes nothing, while tracing is off. An exception passing through is recorded.
    """
    if not tracing_active():
        yield None
        return
    context = parent if parent is not None else (Context() if root else None)
    tracer = trace.get_tracer(_TRACER_NAME)
    with tracer.start_as_current_span(name, context=context, kind=kind, attributes=attributes) as span:
        yield span


def annotate(attributes: Mapping[str, AttributeValue]) -> None:
    """Add attributes to the current span (say, the consumer span a handler runs in); no-op while tracing is off."""
    if tracing_active():
        trace.get_current_span().set_attributes(attributes)


def message_ids(msg: Any) -> dict[str, AttributeValue]:
    """`slipstream.<field>` attributes for the ids a message carries (a scored message's from what it wraps).

    An episode's id is also given as `slipstream.trajectory_id` (its v1 name), so traces and
    dashboards that join on it keep working.
    """
    out: dict[str, AttributeValue] = {}
    inner = getattr(msg, "trajectory", None) or getattr(msg, "episode", None)
    for source in (msg, inner):
        if source is None:
            continue
        for name in ID_FIELDS:
            value = getattr(source, name, None)
            if isinstance(value, str | int | float) and value != "" and f"slipstream.{name}" not in out:
                out[f"slipstream.{name}"] = value
    if "slipstream.episode_id" in out:
        out.setdefault("slipstream.trajectory_id", out["slipstream.episode_id"])
    return out


def delivery_attributes(delivery: Traced, durable: str) -> dict[str, AttributeValue]:
    """Messaging attributes of one delivery, plus the ids its message carries."""
    attrs: dict[str, AttributeValue] = {
        "messaging.system": "nats",
        "messaging.operation.type": "process",
        "messaging.destination.name": delivery.subject,
        "messaging.consumer.group.name": durable,
        "messaging.nats.stream_sequence": delivery.stream_seq,
        "messaging.nats.delivery_count": delivery.num_delivered,
    }
    msg_id = delivery.headers.get(MSG_ID_HEADER)
    if msg_id:
        attrs["messaging.message.id"] = msg_id
    attrs.update(message_ids(delivery.msg))
    return attrs


@contextmanager
def consumer_span(delivery: Traced, durable: str) -> Iterator[Any]:
    """A CONSUMER span, child of the producer's (from the headers), around handling one delivery.

    A handler exception passing through is recorded on the span, which then has status ERROR.
    """
    if not tracing_active():
        yield None
        return
    tracer = trace.get_tracer(_TRACER_NAME)
    with tracer.start_as_current_span(
        f"process {delivery.subject}",
        context=delivery.context,
        kind=SpanKind.CONSUMER,
        attributes=delivery_attributes(delivery, durable),
    ) as span:
        yield span


def link_to(delivery: Traced) -> Link | None:
    """A span link to the producer of `delivery` (None when its headers carried no valid context)."""
    ctx = trace.get_current_span(delivery.context).get_span_context()
    if not ctx.is_valid:
        return None
    attrs: dict[str, AttributeValue] = {"messaging.destination.name": delivery.subject}
    msg_id = delivery.headers.get(MSG_ID_HEADER)
    if msg_id:
        attrs["messaging.message.id"] = msg_id
    return Link(ctx, attrs)


@contextmanager
def batch_span(
    name: str,
    deliveries: Iterable[Traced],
    attributes: Mapping[str, AttributeValue] | None = None,
    *,
    root: bool = True,
) -> Iterator[Any]:
    """A span over work that used many messages (a learner step), linked to each message's producer.

    Links are given at span start, as samplers only see them there. With `root` (the default) the
    span starts a new trace, since it belongs to no single message's; otherwise it is a child of
    the current span. The SDK keeps at most the provider's link limit (`telemetry.tracing.MAX_LINKS`
    for providers set up by `setup_tracing`, else OTEL_SPAN_LINK_COUNT_LIMIT, 128 unless set).
    """
    if not tracing_active():
        yield None
        return
    items = list(deliveries)
    links = [link for link in (link_to(d) for d in items) if link is not None]
    attrs: dict[str, AttributeValue] = {"messaging.batch.message_count": len(items), **(attributes or {})}
    tracer = trace.get_tracer(_TRACER_NAME)
    with tracer.start_as_current_span(name, context=Context() if root else None, links=links, attributes=attrs) as span:
        yield span
