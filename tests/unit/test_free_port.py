"""free_port: ports for servers about to start, kept out of the range outgoing connections use."""

from __future__ import annotations

import socket

from slipstream.stack import free_port
from slipstream.stack.process import _ephemeral_floor


def test_ports_come_from_below_the_ephemeral_range_and_are_never_repeated() -> None:
    floor = _ephemeral_floor()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    if floor > 21000:
        assert all(p < floor for p in ports), [p for p in ports if p >= floor]


def test_a_port_held_by_a_listener_is_not_handed_out() -> None:
    floor = _ephemeral_floor()
    held: list[socket.socket] = []
    try:
        # Hold a block of the low range; none of them may come back.
        taken = set()
        for port in range(20000, 20400):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            s.listen()
            held.append(s)
            taken.add(port)
        got = {free_port() for _ in range(300)}
        assert not got & taken
        assert all(p != 0 for p in got) and (floor <= 21000 or all(p < floor for p in got))
    finally:
        for s in held:
            s.close()
