"""A rendezvous port another process binds later is drawn where no other process takes it."""

from __future__ import annotations

import socket

from tracer.loopback import LOOPBACK, free_port


def _ephemeral_range() -> tuple[int, int]:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = (int(x) for x in f.read().split())
    return low, high


def test_a_rendezvous_port_is_bindable_and_outside_the_ephemeral_range():
    low, high = _ephemeral_range()
    for _ in range(20):
        port = free_port()
        if low - 10000 >= 1000:
            assert 10000 <= port < low
        with socket.socket() as s:
            s.bind((LOOPBACK, port))  # free when drawn


def test_a_port_held_by_a_listener_is_never_drawn():
    low, _ = _ephemeral_range()
    held = []
    try:
        # hold every tenth port of the draw's range: none of them may come back
        for port in range(10000, low, 10):
            s = socket.socket()
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                s.close()
                continue
            s.listen()
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        assert all(free_port() not in taken for _ in range(50))
    finally:
        for s in held:
            s.close()
