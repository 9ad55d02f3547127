"""Sharded checkpoints: a snapshot to host memory, then a persist, in step or in the background.

Layout (``NNNNNN`` = steps done, ``RRRRR`` = rank)::

    RUN/checkpoints/step-NNNNNN/rank-RRRRR/   the rank's shard: a torch.distributed.checkpoint
                                              (DCP) folder (``.metadata``, ``__0_0.distcp``)
    RUN/checkpoints/step-NNNNNN/complete      JSON, once every rank's shard is in place: steps
                                              done, world size, mesh, model, mode
    RUN/checkpoints/latest                    JSON ``{"steps_done": N}``, written last

Saving has two stages, as in MegaScale and torchtitan:

1. **snapshot**, on the training thread (span ``checkpoint_snapshot``): one copy of the rank's
   live state (the engine's tensors, not a clone of them) into host memory: one buffer per
   dtype, allocated on the first snapshot and reused (pinned where CUDA is, so the
   device-to-host copy runs at full speed), plus a pickled skeleton of the structure that
   says where each tensor lies.
2. **persist** (span ``checkpoint_persist``): DCP writes the buffers and the skeleton into
   ``step-N/.rank-R.tmp/`` (files fsync'd, ``.metadata`` last), which is then renamed
   ``rank-R``. The rank then looks for all ``world_size`` shards; the last one to arrive
   necessarily sees them all (every other rename happened before its own) and writes
   ``complete``, then ``latest``. Without ``--checkpoint-async`` this runs on the training
   thread inside the step (kind ``host``): the step waits for the disk. With it,
   ``dcp.async_save`` runs it on DCP's writer thread while training goes on, and the span is
   recorded when it ends, with kind ``background`` (docs/spec.md §2: no step's work). The
   next snapshot reuses the buffers, so it first waits for a persist still running (span
   ``checkpoint_wait``, only when it does wait).

**Why DCP, and how.** ``dcp.async_save`` runs the write on a thread of its own and DCP's
file-system writer gives the format and its fsyncs; we do not write that machinery. What
``async_save`` does on gloo and a CPU (torch 2.13): it checks that the group has a CPU backend,
stages the state through the stager it is given on the calling thread, then starts a one-thread
pool that runs ``dcp.save`` (plan, write the data, ``.metadata`` last) and returns its future.
It runs here with ``no_dist=True``: each rank writes its own shard with no collective. A
coordinated DCP save plans over a process group, which on gloo means collectives issued from
the writer thread while the training thread issues its own: they would need a group of their
own, and the tracer would record them among the training's collectives. Nor would a
coordinated save fit these shards: tensor-parallel ranks hold different slices under the same
parameter names, which DCP's deduplication takes for replicas; and a resume needs the same mesh
anyway (checked by the launcher, see :func:`mismatch`). So the commit across ranks
(``complete``, ``latest``) is ours. DCP's ``THREAD`` executor, not ``PROCESS``: a writer
process would have to join a process group of its own and compete for the same cores. On a
device whose default group has no CPU backend (NCCL), ``async_save`` wants one: a gloo group is
made once for that check (it carries no traffic).

The staging is ours (:class:`_Packer`, handed to DCP through its ``AsyncStager`` interface as
already done): DCP's ``DefaultStager`` copies each tensor into a storage of its own, and DCP
then serializes each tensor apart. For this trainer's ~150 tensors that is ~20 ms of Python on
the writer thread (4 ms for one buffer per dtype, measured on a 2.4 MB shard), and a writer
thread holding the GIL slows the training loop beside it. One buffer per dtype also keeps DCP
from turning the optimizer state's integer keys into strings (it flattens nested dicts
itself), which would not load back as they were.

**Crash safety.** A process killed during a persist leaves a ``.rank-R.tmp`` folder or a step
folder without ``complete``; ``latest`` still names the previous checkpoint, which is whole.
A resume takes the newest complete checkpoint and the launcher removes the incomplete ones
after it (:func:`discard_after`).

A checkpoint holds the engine's shard (parameters, optimizer state, step) and the RNG states
of the process, so a resumed run continues bit for bit: the data of step ``n`` is a pure
function of the seed and ``n`` (see :func:`trainer.data.get_batch`).
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import pickle
import random
import shutil
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

# where checkpoints live, re-exported: callers use trainer.checkpoint for both
from trainer.checkpoint_dirs import (  # noqa: F401
    checkpoints_dir,
    complete_markers,
    discard_after,
    latest_complete,
    mismatch,
    shard_dir,
    step_dir,
)

log = logging.getLogger(__name__)

SKELETON, TENSORS = "skeleton", "tensors"


def rng_state() -> dict[str, Any]:
    """The random generators' states: torch's CPU one, Python's, and CUDA's once CUDA is
    initialized."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (CUDA's where there is CUDA)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# -- the state as DCP sees it: flat tensors and a skeleton -----------------------------------


@dataclass(frozen=True)
class _Slot:
    """Where a tensor lies: ``numel`` elements from ``offset`` in the buffer of ``dtype``."""

    dtype: str
    offset: int
    numel: int
    shape: tuple[int, ...]


def _split(obj: Any, tensors: list[tuple[torch.Tensor, _Slot]], sizes: dict[str, int]) -> Any:
    """The structure of ``obj`` with each tensor replaced by its :class:`_Slot` (the tensor
    and its slot appended to ``tensors``, ``sizes`` counting each dtype's elements); dicts,
    lists and tuples are rebuilt, other values kept."""
    if isinstance(obj, torch.Tensor):
        dtype = str(obj.dtype).removeprefix("torch.")
        slot = _Slot(dtype, sizes.get(dtype, 0), obj.numel(), tuple(obj.shape))
        tensors.append((obj.detach(), slot))
        sizes[dtype] = slot.offset + slot.numel
        return slot
    if isinstance(obj, dict):
        return {k: _split(v, tensors, sizes) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split(v, tensors, sizes) for v in obj)
    return obj


def _join(obj: Any, buffers: dict[str, torch.Tensor]) -> Any:
    """The structure back, each tensor a copy of its own (some readers of a state, such as
    ``torch.set_rng_state``, read a view's storage from its start)."""
    if isinstance(obj, _Slot):
        return buffers[obj.dtype][obj.offset : obj.offset + obj.numel].view(obj.shape).clone()
    if isinstance(obj, dict):
        return {k: _join(v, buffers) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_join(v, buffers) for v in obj)
    return obj


class _Packer:
    """The snapshot: every tensor of the state copied once into one host buffer per dtype,
    allocated on the first snapshot and reused (pinned where CUDA is)."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self.buffers: dict[str, torch.Tensor] = {}

    def pack(self, state: dict[str, Any]) -> dict[str, Any]:
        """What DCP writes: the buffers and the pickled skeleton."""
        tensors: list[tuple[torch.Tensor, _Slot]] = []
        sizes: dict[str, int] = {}
        skeleton = _split(state, tensors, sizes)
        for dtype, n in sizes.items():
            if dtype not in self.buffers or self.buffers[dtype].numel() != n:
                kind = getattr(torch, dtype)
                self.buffers[dtype] = torch.empty(n, dtype=kind, pin_memory=self.pinned)
        for t, slot in tensors:
            into = self.buffers[slot.dtype][slot.offset : slot.offset + slot.numel]
            into.view(slot.shape).copy_(t, non_blocking=self.pinned)
        if self.pinned:
            torch.cuda.synchronize()  # the copies from the device are done
        return {TENSORS: {d: self.buffers[d] for d in sizes},
                SKELETON: io.BytesIO(pickle.dumps(skeleton))}  # fmt: skip


class _Staged:
    """DCP's staging interface (``AsyncStager``) for a state the packer has staged already."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        return None

    def close(self) -> None:
        return None


def _writer(path: str, inside: Callable[[], None] | None) -> Any:
    """DCP's file-system writer into ``path`` (files fsync'd), with ``inside`` called within
    the write: the data is on disk, the ``.metadata`` not yet (the slow-disk fault)."""
    return _writer_class()(path, inside)


@functools.cache
def _writer_class() -> type:
    import torch.distributed.checkpoint as dcp

    class Writer(dcp.FileSystemWriter):
        def __init__(self, path: str, inside: Callable[[], None] | None) -> None:
            super().__init__(path, sync_files=True)
            self.inside = inside
            self.started_ns: int | None = None  # when the write began (on its thread)

        def set_up_storage_writer(self, *args: Any, **kwargs: Any) -> None:
            from tracer.clock import now_ns

            self.started_ns = now_ns()
            super().set_up_storage_writer(*args, **kwargs)

        def finish(self, metadata: Any, results: Any) -> None:
            if self.inside is not None:
                self.inside()
            super().finish(metadata, results)

    return Writer


def _quiet_dcp() -> None:
    """DCP warns on every save and load that ``no_dist`` runs without a process group."""
    warnings.filterwarnings(
        "ignore", message=r"torch\.distributed is disabled", category=UserWarning
    )


# -- saving ----------------------------------------------------------------------------------


class Spans:
    """Where the checkpointer's spans go: ``span(name, kind)`` on the training thread and
    ``record(name, kind, start_ns, end_ns, step)`` for one timed elsewhere; ``now_ns()`` is
    their clock. The default records nothing."""

    def span(self, name: str, kind: str) -> AbstractContextManager[Any]:
        """Nothing: a null context."""
        return nullcontext()

    def record(self, name: str, kind: str, start_ns: int, end_ns: int, step: int) -> None:
        """Nothing."""
        return None

    def now_ns(self) -> int:
        """The tracer's clock (``tracer.clock.now_ns``)."""
        from tracer.clock import now_ns

        return now_ns()


class Checkpointer:
    """Saves this rank's shard every ``every`` steps (0: never), in step or in the background.

    ``manifest`` (mesh, model) goes into the ``complete`` marker, for :func:`mismatch`;
    ``inside_write`` runs inside every persist (the slow_ckpt fault); ``spans`` records the
    snapshot, the persist and the waits.
    """

    def __init__(
        self,
        run_dir: str,
        rank: int,
        world_size: int,
        every: int,
        *,
        background: bool = False,
        manifest: dict[str, Any] | None = None,
        inside_write: Callable[[], None] | None = None,
        spans: Spans | None = None,
        pinned: bool = False,
        on_failure: Callable[[int, BaseException], None] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.world_size = world_size
        self.every = every
        self.background = background
        self.manifest = manifest or {}
        self.inside_write = inside_write
        self.spans = spans or Spans()
        self._packer = _Packer(pinned)
        # async_save wants a group with a CPU backend: the default one, or (NCCL) a gloo group
        # made here, a collective call that every rank makes as it builds its checkpointer
        self._group: Any = _cpu_group() if background and every > 0 else None
        self._done = threading.Event()
        self._done.set()
        self.error: BaseException | None = None
        self.error_step = -1  # the checkpoint (steps done) whose persist failed
        self.on_failure = on_failure
        if every > 0:  # DCP's import (a tenth of a second) now, not in the first saving step
            import torch.distributed.checkpoint  # noqa: F401

            _quiet_dcp()

    def due(self, steps_done: int) -> bool:
        """Whether to save after ``steps_done`` steps: every ``every`` steps (never with 0)."""
        return self.every > 0 and steps_done % self.every == 0

    def save(self, steps_done: int, live_state: dict[str, Any]) -> None:
        """Snapshot ``live_state`` (the engine's own tensors) now; persist it in this step,
        or in the background with ``background``. Re-raises a failed earlier persist.

        With ``on_failure``, a checkpoint that cannot be written (the disk full, read-only,
        gone) raises nothing: ``on_failure(steps_done, error)`` is called, the half-written
        shard removed where it can be, and the training goes on."""
        if self.on_failure is None:
            self._save(steps_done, live_state)
            return
        while True:  # twice at most: an earlier persist's error is reported, then this save
            try:
                self._save(steps_done, live_state)
                return
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                error = root_error(exc)
                if self.error_step >= 0 and self.error is None and isinstance(error, RuntimeError):
                    failed, self.error_step = self.error_step, -1  # the earlier persist's error
                    self.on_failure(failed, root_error(error.__cause__ or error))
                    continue
                shutil.rmtree(
                    os.path.join(step_dir(self.run_dir, steps_done), f".rank-{self.rank:05d}.tmp"),
                    ignore_errors=True,
                )
                self.on_failure(steps_done, error)
                return

    def _save(self, steps_done: int, live_state: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        self.wait()
        state = {"steps_done": steps_done, "rank": self.rank, "world_size": self.world_size,
                 "engine": live_state, "rng": rng_state()}  # fmt: skip
        if not self.background:
            with self.spans.span("checkpoint_snapshot", "host"):
                staged = self._packer.pack(state)
            with self.spans.span("checkpoint_persist", "host"):
                tmp = self._fresh_tmp(steps_done)
                dcp.save(staged, storage_writer=_writer(tmp, self.inside_write), no_dist=True)
                self._commit(steps_done, tmp)
            return
        with self.spans.span("checkpoint_snapshot", "host"):
            tmp = self._fresh_tmp(steps_done)
            writer = _writer(tmp, self.inside_write)
            future = dcp.async_save(
                self._packer.pack(state),
                storage_writer=writer,
                async_stager=_Staged(),
                process_group=self._group,
                no_dist=True,
            )
        # _Staged stages in place (no Future of its own), so DCP answers with the upload's Future
        assert not isinstance(future, AsyncSaveResponse)
        self._done.clear()
        future.add_done_callback(lambda f: self._after_async(f, steps_done, tmp, writer))

    def wait(self) -> None:
        """Block until the persist in flight (if any) is done (span ``checkpoint_wait`` when
        it does block); re-raise its error."""
        if not self._done.is_set():
            with self.spans.span("checkpoint_wait", "host"):
                self._done.wait()
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"checkpoint write failed: {error}") from error

    def close(self) -> None:
        """Wait for the last persist and free the host buffers (with ``on_failure``, a last
        persist that failed is reported to it, not raised)."""
        try:
            try:
                self.wait()
            except RuntimeError as exc:
                if self.on_failure is None:
                    raise
                failed, self.error_step = self.error_step, -1
                self.on_failure(failed, root_error(exc.__cause__ or exc))
        finally:
            self._packer.buffers.clear()

    def _after_async(self, future: Future, steps_done: int, tmp: str, writer: Any) -> None:
        """On DCP's writer thread: commit, record the persist span, release the waiters."""
        try:
            future.result()
            self._commit(steps_done, tmp)
        except BaseException as e:  # reported by the next wait()
            self.error = e
            self.error_step = steps_done
        finally:
            end = self.spans.now_ns()
            start = writer.started_ns if writer.started_ns is not None else end
            self.spans.record("checkpoint_persist", "background", start, end, steps_done - 1)
            self._done.set()

    def _fresh_tmp(self, steps_done: int) -> str:
        tmp = os.path.join(step_dir(self.run_dir, steps_done), f".rank-{self.rank:05d}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)  # a killed earlier attempt's
        os.makedirs(tmp)
        return tmp

    def _commit(self, steps_done: int, tmp: str) -> None:
        """Rename the shard into place; the last rank in writes ``complete``, then ``latest``."""
        final = shard_dir(self.run_dir, steps_done, self.rank)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        shards = [shard_dir(self.run_dir, steps_done, r) for r in range(self.world_size)]
        if all(os.path.isdir(p) for p in shards):
            marker = {"steps_done": steps_done, "world_size": self.world_size,
                      "async": self.background, **self.manifest}  # fmt: skip
            _write_json(os.path.join(step_dir(self.run_dir, steps_done), "complete"), marker)
            _write_json(os.path.join(checkpoints_dir(self.run_dir), "latest"),
                        {"steps_done": steps_done})  # fmt: skip
        log.info("checkpoint: step %d shard written", steps_done)


def root_error(exc: BaseException) -> BaseException:
    """The error under DCP's ``CheckpointException`` (the first rank's: an OSError when the
    disk failed), or ``exc`` itself."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            inner = failure[0] if isinstance(failure, tuple) and failure else failure
            if isinstance(inner, BaseException):
                return inner
    return exc


def _cpu_group() -> Any:
    """None (the default group) when it has a CPU backend (gloo), else a new gloo group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    default = dist.distributed_c10d._get_default_group()
    if torch.device("cpu") in default._device_types:
        return None
    return dist.new_group(backend="gloo")


def _write_json(path: str, obj: dict[str, Any]) -> None:
    """Write ``path`` whole or not at all (a temporary name per process, fsync, rename)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# -- loading ---------------------------------------------------------------------------------


def load(run_dir: str, steps_done: int, rank: int) -> dict[str, Any]:
    """This rank's shard of the checkpoint at ``steps_done``, as :meth:`Checkpointer.save`
    was given it (the engine's state, the RNG states), on the CPU.

    DCP reads the folder with no process group (``no_dist``) and builds the tensors from its
    metadata (its ``_EmptyStateDictLoadPlanner``, what ``dcp_to_torch_save`` uses)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _quiet_dcp()
    flat: dict[str, Any] = {}
    reader = dcp.FileSystemReader(shard_dir(run_dir, steps_done, rank))
    _load_state_dict(flat, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)  # fmt: skip
    state = _join(pickle.loads(flat[SKELETON].getvalue()), flat[TENSORS])
    if state.get("rank") != rank:
        raise ValueError(f"checkpoint shard for rank {rank} holds rank {state.get('rank')}")
    return state
