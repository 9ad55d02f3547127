"""A timed span of one rank (compute, communication, data...): the context manager behind
``tracer.span`` and the automatic spans of ``tracer.autospans``. It stamps the host clock, or a
CUDA event on the current stream for device work, and adds a ``spans`` row on exit. A
host-timed span also counts the CPU time its thread spent inside it (``cpu_ns``) and the time it
waited, runnable, for a core (``runq_ns``)."""

from __future__ import annotations

from time import perf_counter_ns
from typing import TYPE_CHECKING

from tracer.clock import cpu_mark, thread_since

if TYPE_CHECKING:
    from tracer.core import Tracer

HOST_KINDS = ("data", "host", "background")  # timed on the host clock even on a GPU


class Span:
    """One span: entering stamps its start, leaving adds its ``spans`` row (the module docstring). A
    ``microbatch`` of -1 takes the enclosing span's."""

    __slots__ = ("tr", "name", "kind", "mb", "prev", "start", "cuda", "cpu")

    def __init__(self, tr: Tracer, name: str, kind: str, microbatch: int) -> None:
        self.tr, self.name, self.kind, self.mb = tr, name, kind, microbatch
        self.cuda = tr.timer is not None and kind not in HOST_KINDS

    def __enter__(self) -> Span:
        t0 = perf_counter_ns()
        tr = self.tr
        self.prev = tr.mb
        if self.mb < 0:
            self.mb = self.prev
        else:
            tr.mb = self.mb
        self.start = tr.stamp(self.cuda) if tr.enabled else None
        self.restart_cpu()
        tr.budget.capture_ns += perf_counter_ns() - t0
        return self

    def restart_cpu(self) -> None:
        """Begin the span's CPU time now, on this thread (host-timed spans of an enabled
        tracer only)."""
        self.cpu = cpu_mark() if self.start is not None and not self.cuda else None

    def __exit__(self, *exc: object) -> None:
        t0 = perf_counter_ns()
        tr = self.tr
        tr.mb = self.prev
        if tr.enabled and self.start is not None:
            try:
                end = tr.stamp(self.cuda)
                source = "host" if isinstance(self.start, int) else "cuda"
                cpu, runq = thread_since(self.cpu)
                tr.buffers["spans"].add(
                    (tr.step_no, self.mb, self.name, self.kind, self.start, end, source, cpu, runq)
                )
            except Exception as e:
                tr.fail(e)
        tr.budget.capture_ns += perf_counter_ns() - t0
