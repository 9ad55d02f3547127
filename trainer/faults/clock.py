"""The time a rank spends blocked in communication (:data:`COMM_CLOCK`, kept by the link
wrappers, left out of the compute that ``slow_rank`` stretches), and a sleep that wakes on
time on average."""

from __future__ import annotations

import logging
import time
from collections import deque

log = logging.getLogger(__name__)


class CommClock:
    """Seconds this process has spent blocked in ``torch.distributed`` calls.

    Kept by :class:`LinkFaults`' wrappers (installed when a slow link is injected anywhere or
    a slow rank on this rank): the time inside a blocking call, and inside ``wait()`` of the
    Work an async call returned. ``sync_cuda`` is set while a slowed compute span runs on
    CUDA: the wrappers then synchronize the device before and after the communication, so
    that the device time of the collective (its waiting included) counts as blocked and the
    compute queued before it does not.
    """

    def __init__(self) -> None:
        self.blocked_s = 0.0
        self.sync_cuda = False


COMM_CLOCK = CommClock()

# How late the latest sleeps woke, in ns: a loaded machine wakes a sleeper a little after the
# time asked for, and a fault that stretches a 0.3 ms transfer must not add 0.1 ms of that.
_LATE: deque[int] = deque([0], maxlen=64)


def sleep_until(deadline_ns: int) -> None:
    """Sleep until ``deadline_ns`` (``time.time_ns``), waking on time on average: each sleep
    asks to wake early by the median lateness of the recent ones."""
    late = sorted(_LATE)[len(_LATE) // 2]
    wake = deadline_ns - late
    pause = wake - time.time_ns()
    if pause <= 0:
        return
    time.sleep(pause / 1e9)
    _LATE.append(max(time.time_ns() - wake, 0))
