"""W3C trace context on NATS headers: injected on every publish, extracted on every delivery.

Context always travels (so a trace can follow a task through the services), but spans are only
opened when a real tracer provider is installed: with the API's default proxy provider a span per
message would cost microseconds for nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context, get_current
from opentelemetry.trace import NoOpTracerProvider, ProxyTracerProvider, SpanKind

_TRACER_NAME = "slipstream.bus"


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
def consumer_span(subject: str, ctx: Context, durable: str) -> Iterator[Any]:
    """A CONSUMER span, child of the producer's, around handling one delivery."""
    if not tracing_active():
        yield None
        return
    tracer = trace.get_tracer(_TRACER_NAME)
    with tracer.start_as_current_span(
        f"process {subject}",
        context=ctx,
        kind=SpanKind.CONSUMER,
        attributes={
            "messaging.system": "nats",
            "messaging.destination.name": subject,
            "messaging.consumer.group.name": durable,
        },
    ) as span:
        yield span
