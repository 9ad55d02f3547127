"""What the collective wrappers hand back and put in place: a Work whose ``wait()`` ends its
call's rows, or the completion of its future where the caller waits on that instead (a DDP
comm hook hands the future to DDP's reducer, which waits in C++) (:class:`TracedWork`), and a wrapper that compares equal to the function it wraps
(:class:`Wrapped`, for ``P2POp``'s check of ``isend``/``irecv``)."""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

if TYPE_CHECKING:
    from tracer.core import Tracer


class WorkOwner(Protocol):
    """What a :class:`TracedWork` asks of the recorder whose call returned it
    (:class:`tracer.collectives.Recorder`, which imports this module)."""

    @property
    def tr(self) -> Tracer:
        """The recorder's tracer."""
        ...

    def waiting(self, rows: list[list[Any]]) -> None:
        """The rank begins to wait for ``rows``."""
        ...

    def complete(self, rows: list[list[Any]], failed: bool = False) -> None:
        """End ``rows`` now."""
        ...


class TracedWork(dist.Work):
    """A Work whose ``wait()`` also ends the rows of the call that returned it."""

    def __init__(self, inner: Any, recorder: WorkOwner, rows: list[list[Any]]) -> None:
        super().__init__()
        self._inner = inner
        self._recorder = recorder
        self._rows = rows
        self._watched = False  # the rows end when the future completes (get_future)

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        """Wait for the real Work, then end the call's rows (as failed if the wait raised)."""
        t0 = perf_counter_ns()
        self._recorder.waiting(self._rows)
        t1 = perf_counter_ns()
        try:
            out = self._inner.wait(*args, **kwargs)
        except BaseException:
            self._recorder.complete(self._rows, failed=True)
            raise
        t2 = perf_counter_ns()
        self._recorder.complete(self._rows)
        self._recorder.tr.budget.capture_ns += t1 - t0 + perf_counter_ns() - t2
        return out

    def is_completed(self) -> bool:
        """The real Work's."""
        return self._inner.is_completed()

    def is_success(self) -> bool:
        """The real Work's."""
        return self._inner.is_success()

    def exception(self) -> Any:
        """The real Work's."""
        return self._inner.exception()

    def source_rank(self) -> int:
        """The real Work's."""
        return self._inner.source_rank()

    def _source_rank(self) -> int:
        return self._inner._source_rank()

    def result(self) -> Any:
        """The real Work's."""
        return self._inner.result()

    def synchronize(self) -> Any:
        """The real Work's."""
        return self._inner.synchronize()

    def get_future(self) -> Any:
        """The real Work's future, whose completion (on the backend's thread) ends the call's
        rows, for a caller that waits on the future and never calls ``wait()``."""
        fut = self._inner.get_future()
        if not self._watched:
            self._watched = True
            try:
                fut.add_done_callback(self._done)
            except Exception as exc:
                self._recorder.tr.fail(exc)
        return fut

    def _done(self, fut: Any) -> None:
        """The future completed: end the rows (as failed if it holds an error). Never raises:
        it runs on the backend's thread."""
        try:
            try:
                fut.value()
                failed = False
            except Exception:
                failed = True
            self._recorder.complete(self._rows, failed=failed)
        except Exception as exc:
            self._recorder.tr.fail(exc)

    def get_future_result(self) -> Any:
        """The real Work's."""
        return self._inner.get_future_result()

    def block_current_stream(self) -> Any:
        """The real Work's."""
        return self._inner.block_current_stream()

    def boxed(self) -> Any:
        """The real Work's."""
        return self._inner.boxed()

    def _get_op_type(self) -> Any:
        return self._inner._get_op_type()

    def _get_duration(self) -> float:
        return self._inner._get_duration()


class Wrapped:
    """A callable wrapper that compares equal to the function it wraps.

    ``P2POp`` checks ``op in [isend, irecv]`` against the module's current names, so a P2POp
    built with a reference taken before attach must still pass; isend and irecv use this.
    """

    def __init__(self, fn: Callable[..., Any], wrapper: Callable[..., Any]) -> None:
        self.__wrapped__ = fn
        self._call = wrapper
        self.__name__ = getattr(fn, "__name__", "wrapped")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapper."""
        return self._call(*args, **kwargs)

    def __eq__(self, other: object) -> bool:
        return other is self or other is self.__wrapped__

    def __hash__(self) -> int:
        return hash(self.__wrapped__)
