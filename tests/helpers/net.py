"""Loopback only: every server and process group a test starts listens on 127.0.0.1, on a port
from :func:`tracer.loopback.free_port` (outside the kernel's ephemeral range)."""

from __future__ import annotations

from tracer.loopback import LOOPBACK, free_port

__all__ = ["LOOPBACK", "free_port"]
