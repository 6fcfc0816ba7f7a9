"""The streams and durable consumers a bus provisions and binds to, read from the subject table.

Both backends resolve subjects and durables through this one object. Tests may pass a patched
copy of the table (say, a 1 s ack_wait) without touching `slipstream.schemas.subjects`.

A consumer is created on the server with `max_deliver + 1`: the last delivery is the spare one the
bus uses to dead-letter a message whose handler never succeeded (even when the consumer process
died on its last try), instead of leaving it stuck in the stream where no backlog metric sees it.
"""

from __future__ import annotations

from collections.abc import Sequence

from slipstream.schemas.subjects import STREAMS, ConsumerSpec, StreamSpec, spec_for, subjects_of

# Deliveries reserved beyond the table's max_deliver so the bus itself can dead-letter.
SPARE_DELIVERIES = 1


class Topology:
    """Streams by name, with their subjects and consumers."""

    def __init__(self, streams: Sequence[StreamSpec] = STREAMS) -> None:
        self.streams: dict[str, StreamSpec] = {s.name: s for s in streams}
        self.subjects: dict[str, list[str]] = {s.name: subjects_of(s.name) for s in streams}
        for name, subjects in self.subjects.items():
            if not subjects:
                raise ValueError(f"stream {name!r} has no subjects in slipstream.schemas.subjects.SUBJECTS")
        self._by_subject: dict[str, StreamSpec] = {}

    def stream(self, name: str) -> StreamSpec:
        try:
            return self.streams[name]
        except KeyError:
            raise KeyError(f"unknown stream {name!r}; known: {sorted(self.streams)}") from None

    def consumer(self, durable: str) -> tuple[StreamSpec, ConsumerSpec]:
        for s in self.streams.values():
            for c in s.consumers:
                if c.durable == durable:
                    return s, c
        known = [c.durable for s in self.streams.values() for c in s.consumers]
        raise KeyError(f"unknown durable consumer {durable!r}; the subject table has {known}")

    def stream_of(self, subject: str) -> StreamSpec:
        """The stream that captures a concrete subject (cached: called on every subscribe)."""
        found = self._by_subject.get(subject)
        if found is None:
            found = self.stream(spec_for(subject).stream)
            self._by_subject[subject] = found
        return found


def server_max_deliver(spec: ConsumerSpec) -> int:
    return spec.max_deliver + SPARE_DELIVERIES if spec.max_deliver > 0 else -1
