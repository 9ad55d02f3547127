"""Optimizer states offloaded to host memory, their update interleaved with the next step.

After Deep Optimizer States (Maurya et al., 2024): ``--optimizer-offload FRACTION`` keeps that
share of each rank's optimizer state in host memory (pinned where CUDA is present) and
updates it on a host thread while the GPU goes on. The share is the tail of every bucket's
master slice (``trainer.parallel.data_parallel``), ``round(FRACTION * S)`` of its ``S``
elements: its float32 master copy and its Adam moments live only on the host, and the
slice's tail on the device is the staging place the updated parameters come back to before
the bucket is all-gathered. AdamW is element-wise, so splitting a slice this way changes no
number: the host share's master, moments, masked weight decay and learning rate are exactly
those the device would have used (``ShardedAdamW`` on each share).

One step (:meth:`OffloadedAdamW.step`, called after the gradients are reduced and clipped):

1. The reduced gradients' tails *go down* (``d2h``): copied into pinned host buffers, on a
   side CUDA stream that first waits for the clip (on a CPU, real copies between separate
   tensors on the offload thread), every bucket's first.
2. The device share is updated on the device as without offload; the buckets wait.
3. The offload thread updates each bucket's host share (``host_update``) and copies the
   parameters *back up* (``h2d``) into the device slice's tail, bucket by bucket in the order
   the next forward uses them (the last bucket holds the first layers).
4. The next step's forward runs meanwhile. Before a module's forward uses a parameter of a
   bucket still in flight, a pre-hook waits for that bucket (span ``offload_wait``, kind
   ``offload``: the time a step waited on offload traffic), makes the current stream wait
   for its copy, and all-gathers it over its group. Every DP peer runs the same modules in
   the same order, so the gathers match. The next step's ``zero_grads`` first waits for the
   gradients to have gone down (the same span when it has to wait).

Each transfer and host update is a span of kind ``offload`` with its bytes, ``direction``
(``d2h|h2d|host_update``) and ``stream`` (``copy``: the side stream, or the offload thread on a
CPU; ``host``: the update thread), timed by CUDA events on the side stream on a GPU and by
the host clock otherwise. ``slow_copy`` (the ``slow_offload`` fault) runs inside each
transfer.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tracer.clock import now_ns
from trainer.config import TrainConfig
from trainer.optim import ShardedAdamW
from trainer.parallel.data_parallel import Bucket

log = logging.getLogger(__name__)

Record = Callable[..., None]  # tracer.api.record_span's signature


@dataclass
class HostShare:
    """The offloaded tail ``[lo, S)`` of bucket ``index``'s slice: host master and gradient
    (pinned on CUDA), the device views they copy from and to, and whether the bucket's
    parameters are back (``ready``) and gathered (``pending`` False)."""

    index: int
    lo: int
    dev_master: torch.Tensor
    dev_grad: torch.Tensor
    host_master: torch.Tensor
    host_grad: torch.Tensor
    opt: ShardedAdamW
    ready: threading.Event = field(default_factory=threading.Event)
    h2d_done: Any = None  # a CUDA event on the side stream (GPU)
    pending: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of the host master."""
        return self.host_master.numel() * self.host_master.element_size()


def _stop(jobs: queue.Queue, thread: threading.Thread) -> None:
    jobs.put(None)
    thread.join(timeout=30)


def split_point(numel: int, fraction: float) -> int:
    """Where a slice of ``numel`` elements splits: the first ``numel - round(fraction *
    numel)`` stay on the device, the rest go to the host."""
    return numel - int(round(fraction * numel))


class OffloadedAdamW:
    """AdamW over the buckets' master slices, ``fraction`` of each kept and updated on the
    host (see the module docstring). ``gather(i)`` all-gathers bucket ``i``'s parameters;
    ``hooks`` supplies ``span`` (the wait), and optionally ``record_span`` (the transfers'
    spans, ``tracer.api.record_span``) and ``slow_copy`` (the fault's delay)."""

    def __init__(
        self,
        buckets: list[Bucket],
        cfg: TrainConfig,
        *,
        gather: Callable[[int], None],
        hooks: Any,
    ) -> None:
        self.buckets, self.gather, self.hooks = buckets, gather, hooks
        self.record: Record | None = getattr(hooks, "record_span", None)
        self.slow_copy: Callable[[], None] | None = getattr(hooks, "slow_copy", None)
        self.step_no = -1
        self.cuda = bool(buckets) and buckets[0].master.is_cuda
        self.side = torch.cuda.Stream() if self.cuda else None
        self.shares: list[HostShare] = []
        heads, head_decay = [], []
        for i, b in enumerate(buckets):
            lo = split_point(b.master.numel(), cfg.optimizer_offload)
            if lo > 0:
                heads.append(b.master[:lo])
                head_decay.append(b.decay[:lo])
            if lo < b.master.numel():
                self.shares.append(self._share(i, b, lo, cfg))
        self.device_opt = ShardedAdamW(heads, head_decay, cfg) if heads else None
        self._jobs: queue.Queue[tuple[int, float, Any] | None] = queue.Queue()
        self._grads_down = threading.Event()
        self._grads_down.set()
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="optimizer-offload", daemon=True)
        self._thread.start()
        # an engine dropped without close(), or a process exiting: end the thread first (a
        # thread still alive in torch when the interpreter ends aborts the process)
        weakref.finalize(self, _stop, self._jobs, self._thread)

    def _share(self, i: int, b: Bucket, lo: int, cfg: TrainConfig) -> HostShare:
        def host(t: torch.Tensor) -> torch.Tensor:
            out = t.detach().to("cpu", copy=True)
            return out.pin_memory() if self.cuda else out

        host_master = host(b.master[lo:])
        return HostShare(
            index=i,
            lo=lo,
            dev_master=b.master[lo:],
            dev_grad=b.shard_grad[lo:],
            host_master=host_master,
            host_grad=host(b.shard_grad[lo:]),
            opt=ShardedAdamW([host_master], [b.decay[lo:].cpu()], cfg),
        )

    @property
    def pending(self) -> set[int]:
        """The buckets whose parameters are not gathered yet."""
        return {s.index for s in self.shares if s.pending}

    # -- the training thread -------------------------------------------------------------------
    def step(self, grads: list[torch.Tensor], lr: float, step: int | None = None) -> None:
        """Send the host shares' gradients down and start their update, then update the
        device share. ``grads`` are the buckets' reduced (and clipped) slices; ``step`` the
        step the transfers' spans belong to (default: one past the last)."""
        del grads  # the shares hold views of them
        self._raise()
        self.step_no = self.step_no + 1 if step is None else step
        if self.shares:
            ready = None
            if self.cuda:
                ready = torch.cuda.Event()
                ready.record()
            for s in self.shares:
                s.ready.clear()
                s.pending = True
            self._grads_down.clear()
            self._idle.clear()
            self._jobs.put((self.step_no, lr, ready))
        if self.device_opt is not None:
            heads = [b.shard_grad[: m.numel()] for b, m in self._heads()]
            self.device_opt.step(heads, lr)

    def _heads(self) -> Iterator[tuple[Bucket, torch.Tensor]]:
        shares = {s.index: s.lo for s in self.shares}
        for i, b in enumerate(self.buckets):
            lo = shares.get(i, b.master.numel())
            if lo > 0:
                yield b, b.master[:lo]

    def before_zero_grads(self) -> None:
        """Wait until the last step's gradients have gone down (their buffers are reused)."""
        if not self._grads_down.is_set():
            with self.hooks.span("offload_wait", "offload"):
                self._grads_down.wait()
        self._raise()

    def ensure(self, indices: list[int]) -> None:
        """Before parameters of these buckets are used: wait for each one still in flight,
        then gather it (in bucket order from the last: the order the forward meets them)."""
        todo = [s for s in self.shares if s.pending and s.index in indices]
        if not todo:
            return
        todo.sort(key=lambda s: -s.index)
        # on a GPU the span's events, on the current stream, also time its wait for the copies
        if self.cuda or not all(s.ready.is_set() for s in todo):
            with self.hooks.span("offload_wait", "offload"):
                for s in todo:
                    s.ready.wait()
                    if s.h2d_done is not None and self._error is None:
                        torch.cuda.current_stream().wait_event(s.h2d_done)
        self._raise()
        for s in todo:
            self.gather(s.index)
            s.pending = False

    def ensure_all(self) -> None:
        """:meth:`ensure` for every offloaded bucket."""
        self.ensure([s.index for s in self.shares])

    def install(self, stage: nn.Module) -> list[Any]:
        """A forward pre-hook on every module that owns parameters of an offloaded bucket:
        it calls :meth:`ensure` for them. Returns the hooks' handles."""
        owner = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        offloaded = {s.index for s in self.shares}
        handles = []
        for module in stage.modules():
            mine = sorted(
                {owner[id(p)] for p in module.parameters(recurse=False) if id(p) in owner}
                & offloaded
            )
            if mine:
                hook = torch.compiler.disable(lambda _m, _a, mine=mine: self.ensure(mine))
                handles.append(module.register_forward_pre_hook(hook))
        return handles

    def drain(self) -> None:
        """Wait for the offload thread to finish its work (no collective)."""
        self._idle.wait()
        self._raise()

    def close(self) -> None:
        """Stop the offload thread after the work queued (waits up to 30 s)."""
        _stop(self._jobs, self._thread)

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"optimizer offload failed: {self._error}") from self._error

    # -- the offload thread --------------------------------------------------------------------
    def _work(self) -> None:
        if self.side is not None:
            torch.cuda.set_device(self.side.device)  # this thread's copies and events
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._run(*job)
            except BaseException as e:  # handed to the training thread at its next wait
                log.exception("optimizer offload failed")
                self._error = e
                self._grads_down.set()
                for s in self.shares:
                    s.ready.set()
            finally:
                self._idle.set()

    def _run(self, step: int, lr: float, grads_ready: Any) -> None:
        order = sorted(self.shares, key=lambda s: -s.index)  # the forward's order
        for s in order:
            self._copy(s.host_grad, s.dev_grad, "d2h", step, grads_ready)
        self._grads_down.set()
        for s in order:
            t0 = now_ns()
            s.opt.step([s.host_grad], lr)
            self._span(t0, now_ns(), step, s.nbytes, "host_update", "host")
            s.h2d_done = self._copy(s.dev_master, s.host_master, "h2d", step, None)
            s.ready.set()

    def _copy(
        self, dst: torch.Tensor, src: torch.Tensor, direction: str, step: int, after: Any
    ) -> Any:
        """One transfer, timed and recorded; on a GPU on the side stream (after ``after``),
        and the worker waits for a d2h copy (the host update reads it). Returns the copy's
        end event on a GPU, else None."""
        nbytes = src.numel() * src.element_size()
        if self.side is None:
            t0 = now_ns()
            dst.copy_(src)
            if self.slow_copy is not None:
                self.slow_copy()
            self._span(t0, now_ns(), step, nbytes, direction, "copy")
            return None
        if self.slow_copy is not None:
            self.slow_copy()  # on the host, before the copy is queued
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.side):
            if after is not None:
                self.side.wait_event(after)
            start.record(self.side)
            dst.copy_(src, non_blocking=True)
            end.record(self.side)
        if direction == "d2h":
            end.synchronize()
        self._span(start, end, step, nbytes, direction, "copy")
        return end

    def _span(
        self, start: Any, end: Any, step: int, nbytes: int, direction: str, stream: str
    ) -> None:
        if self.record is not None:
            name = "offload_update" if direction == "host_update" else f"offload_{direction}"
            self.record(
                name,
                "offload",
                start,
                end,
                step=step,
                nbytes=nbytes,
                direction=direction,
                stream=stream,
            )

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The device optimizer's state (None without one) and each host share's."""
        return {
            "device": None if self.device_opt is None else self.device_opt.state_dict(),
            "host": [s.opt.state_dict() for s in self.shares],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned, once the offload thread is idle."""
        self.drain()
        if self.device_opt is not None:
            self.device_opt.load_state_dict(state["device"])
        for s, st in zip(self.shares, state["host"], strict=True):
            s.opt.load_state_dict(st)
