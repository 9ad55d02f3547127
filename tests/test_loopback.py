"""A rendezvous port another process binds later is drawn where no other process takes it."""

from __future__ import annotations

import socket

from tracer.loopback import LOOPBACK, free_port


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_a_rendezvous_port_is_bindable_and_outside_the_ephemeral_range():
    low = _ephemeral_low()
    for _ in range(20):
        port = free_port()
        if low - 10000 >= 1000:
            assert 10000 <= port < low
        with socket.socket() as s:
            s.bind((LOOPBACK, port))  # free when drawn


def test_a_port_held_by_a_listener_is_never_drawn():
    low = _ephemeral_low()
    held = []
    try:
        # hold every 40th port of the draw's range (some 570 sockets, within a default limit of
        # 1024 open files): none may come back in 200 draws (a draw that did not check would
        # return one with a chance of 1 - (39/40)**200, above 99%)
        for port in range(10000, low, 40):
            s = socket.socket()
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                s.close()
                continue
            s.listen()
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        assert all(free_port() not in taken for _ in range(200))
    finally:
        for s in held:
            s.close()
