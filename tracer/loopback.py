"""A loopback port for a server another process binds: torchrun's rendezvous, a dashboard.

The usual recipe, ``bind(("127.0.0.1", 0))`` then close, returns a port from the kernel's
ephemeral range, the range every outgoing connection and every other ``bind(0)`` on the machine
draws from. Between that close and the child's own bind (a second or more while torchrun starts)
any process may take the port, and the child fails with "address already in use": a launch that
fails before any rank reports. :func:`free_port` draws below that range instead, where only a
process that names its port binds.
"""

from __future__ import annotations

import random
import socket

LOOPBACK = "127.0.0.1"

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_LINUX_EPHEMERAL_LOW = 32768  # Linux's default; macOS and Windows start theirs higher
_LOWEST = 10000  # below: the well-known services' ports
_TRIES = 64


def _ephemeral_low() -> int:
    try:
        with open(_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _LINUX_EPHEMERAL_LOW


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1, free now and outside the kernel's ephemeral range (where no
    outgoing connection or ``bind(0)`` takes it before the child binds it); an ephemeral one
    where that range leaves no room below it."""
    low = _ephemeral_low()
    if low - _LOWEST >= 1000:
        draw = random.SystemRandom()
        for _ in range(_TRIES):
            port = draw.randrange(_LOWEST, low)
            if _bindable(port):
                return port
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])
