"""The per-rank training loop: ``python -m trainer.train RUN`` (started by torchrun).

The launcher leaves the resolved configuration in ``RUN/.progress/launch.json``. Each rank:

1. reports ``start`` progress (so the launcher knows its pid at once), joins the process group
   (gloo on CPU, NCCL on CUDA) with a timeout well above ``--hang-timeout``, so that the
   launcher, not the collective library, decides when a run is hung;
2. builds the :class:`~trainer.parallel.mesh.Mesh`, installs the slow-link faults by wrapping
   ``torch.distributed`` and only **then** attaches the tracer, whose collective timing thereby
   includes the injected transfer delay;
3. builds the :class:`~trainer.engine.Engine` with :class:`RankHooks` (tracer spans around the
   engine's compute, with the compute faults applied inside them) and, on ``--resume``, loads
   its shard of the latest complete checkpoint;
4. loops: ``tracer.step(n)``; the pause fault; the data span (with the slow-data fault), in
   which the batch is loaded (its rows per microbatch set by the ``seq_skew`` faults:
   ``trainer.faults.replica_rows``) and each microbatch's work is recorded (``tokens`` and
   ``attention`` rows of the ``work`` table, host bookkeeping only);
   ``engine.train_step`` with the replica's loss weight (its rows over the mean); progress;
   a checkpoint every N steps (its snapshot and, unless ``--checkpoint-async``, its persist
   inside the step: trainer/checkpoint.py);
5. shuts down: waits for the checkpoint writer, closes the tracer, ``gc.collect()`` and then
   ``destroy_process_group`` (collecting first avoids gloo's abort at exit).

Exit status: 0 when every step ran, 1 on an error (logged with its traceback, with a rank
prefix); an injected crash exits 1 abruptly from inside the loop.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from trainer import checkpoint, lifeline, memory, progress
from trainer.cliconfig import LaunchConfig, from_mapping
from trainer.data import Batch, make_batch
from trainer.faults import LinkFaults, RankFaults, replica_rows

log = logging.getLogger("megascope.rank")


class RankHooks:
    """The engine's hooks on a training rank: a tracer span, compute faults inside it."""

    def __init__(self, tracer: Any | None, faults: RankFaults) -> None:
        self.tracer = tracer
        self.faults = faults

    @contextlib.contextmanager
    def span(self, name: str, kind: str = "compute", microbatch: int = -1) -> Iterator[None]:
        """The tracer's span (when traced), with the compute faults inside it for a compute span."""
        outer = (
            self.tracer.span(name, kind=kind, microbatch=microbatch)
            if self.tracer is not None
            else contextlib.nullcontext()
        )
        inner = self.faults.compute() if kind == "compute" else contextlib.nullcontext()
        with outer, inner:
            yield

    def record_span(self, name: str, kind: str, start: Any, end: Any, **attrs: Any) -> None:
        """A span timed by the caller on another thread or stream (the optimizer offload's
        transfers): ``tracer.record_span``."""
        if self.tracer is not None:
            self.tracer.record_span(name, kind, start, end, **attrs)

    def slow_copy(self) -> None:
        """Inside every optimizer-offload transfer: the slow_offload fault's delay."""
        self.faults.slow_copy()


class CheckpointSpans(checkpoint.Spans):
    """The checkpointer's spans, in the tracer (``tracer`` is ``tracer.api``; None: untraced)."""

    def __init__(self, tracer: Any | None) -> None:
        self.tracer = tracer

    def span(self, name: str, kind: str) -> contextlib.AbstractContextManager[Any]:
        """The tracer's span (a null context when untraced)."""
        return self.tracer.span(name, kind=kind) if self.tracer else contextlib.nullcontext()

    def record(self, name: str, kind: str, start_ns: int, end_ns: int, step: int) -> None:
        """``tracer.record_span`` for a span timed elsewhere (nothing when untraced)."""
        if self.tracer is not None:
            self.tracer.record_span(name, kind, start_ns, end_ns, step=step)


def tracer_config(cfg: LaunchConfig) -> Any:
    """The tracer's settings for this run: its hang watchdog fires at ``--hang-timeout``."""
    from tracer.config import TracerConfig

    return TracerConfig.from_env(TracerConfig(hang_timeout_s=cfg.run.hang_timeout))


def _attach_tracer(cfg: LaunchConfig, mesh: Any) -> Any | None:
    """Attach the tracer (after the link faults are installed); None when it is unavailable.

    Returns the ``tracer.api`` module, whose ``step``/``span``/``close`` act on the attached
    tracer of this process.
    """
    try:
        import tracer.api as api
    except ImportError:
        log.warning("tracer unavailable: running untraced")
        return None
    groups = {a: pg for a, pg in mesh.groups.items() if pg is not None and mesh.size(a) > 1}
    # The trainer says what it does (steps, spans): no automatic steps and spans.
    api.attach(
        cfg.run.out, mesh=dict(mesh.sizes), groups=groups, config=tracer_config(cfg), auto=False
    )
    return api


def _record_work(tracer: Any | None, batch: Batch) -> None:
    """The ``tokens`` and ``attention`` work of each microbatch of ``batch`` (current step)."""
    if tracer is None:
        return
    for mb, attention in enumerate(batch.attention):
        tracer.record_work("tokens", batch.tokens_per_microbatch, microbatch=mb)
        tracer.record_work("attention", attention, microbatch=mb)


def _report_model(cfg: LaunchConfig, engine: Any, writer: progress.ProgressWriter) -> None:
    name = torch.cuda.get_device_name() if cfg.train.device == "cuda" else None
    writer.model_report(
        {
            "params": int(engine.n_params),
            "flops_per_token": float(engine.flops_per_token),
            "device_name": name,
        },
    )


def _install_router_faults(cfg: LaunchConfig, engine: Any) -> None:
    """``hot_expert``: every router of this rank favours the expert (trainer/moe.py)."""
    from trainer.moe import set_hot_expert

    for f in cfg.run.faults:
        if f.kind == "hot_expert":
            set_hot_expert(engine.stage, f.expert, f.share)


def _resume(cfg: LaunchConfig, rank: int, engine: Any) -> int:
    """Load this rank's shard of the latest complete checkpoint; return the first step to run."""
    if not cfg.run.resume:
        return 0
    steps_done = checkpoint.latest_complete(cfg.run.out, cfg.world_size)
    if steps_done is None:
        raise RuntimeError(f"--resume: no complete checkpoint in {cfg.run.out}")
    state = checkpoint.load(cfg.run.out, steps_done, rank)
    engine.load_state_dict(state["engine"])
    checkpoint.set_rng_state(state["rng"])
    log.info("resumed from the checkpoint at step %d", steps_done)
    return steps_done


def train(cfg: LaunchConfig, rank: int, writer: progress.ProgressWriter | None = None) -> int:
    """Build everything on this rank and run the steps; returns the number of steps run.

    ``writer`` takes the progress (a new one when None, closed at the end; the caller closes
    its own); no write of megascope's, nor a checkpoint that cannot be written, fails or holds
    a step (trainer/progress.py)."""
    own_writer = writer is None
    writer = writer or progress.ProgressWriter(cfg.run.out, rank)
    try:
        return _train(cfg, rank, writer)
    finally:
        if own_writer:
            writer.close()


def _train(cfg: LaunchConfig, rank: int, writer: progress.ProgressWriter) -> int:
    from trainer.engine import Engine
    from trainer.parallel.mesh import Mesh

    run_dir, device = cfg.run.out, cfg.train.device
    mesh = Mesh(cfg.parallel)
    faults = RankFaults(cfg.run.faults, rank, device)
    LinkFaults(cfg.run.faults, rank, device).install()  # before the tracer: see the docstring
    tracer = _attach_tracer(cfg, mesh) if cfg.run.trace else None
    hooks = RankHooks(tracer, faults)
    engine = Engine(cfg.model, cfg.train, mesh, hooks)
    _install_router_faults(cfg, engine)
    start = _resume(cfg, rank, engine)
    if rank == 0:
        _report_model(cfg, engine, writer)
    writer.rank_line(start - 1, "ready")
    saver = checkpoint.Checkpointer(
        run_dir,
        rank,
        cfg.world_size,
        cfg.train.checkpoint_every,
        background=cfg.train.checkpoint_async,
        manifest={"mesh": cfg.parallel.sizes, "model": cfg.to_mapping()["model"]},
        inside_write=faults.slow_disk,
        spans=CheckpointSpans(tracer),
        pinned=device == "cuda",
        on_failure=writer.checkpoint_missing,
    )
    dp_index = mesh.coords["dp"]
    rows = replica_rows(cfg.run.faults, mesh.sizes, cfg.train.micro_batch_size)
    loss_weight = rows[dp_index] * len(rows) / sum(rows)  # 1 unless a seq_skew acts
    end = min(cfg.train.steps, cfg.run.stop_after or cfg.train.steps)
    pending: tuple[int, torch.Tensor, float, bool] | None = None  # rank 0's step to log
    try:
        for step in range(start, end):
            t0 = time.perf_counter()
            if tracer is not None:
                tracer.step(step)
            faults.begin_step(step)
            with hooks.span("data", kind="data"), faults.data():
                batch = make_batch(
                    seed=cfg.train.seed,
                    step=step,
                    dp_rank=dp_index,
                    microbatches=cfg.train.microbatches,
                    micro_batch_size=rows[dp_index],
                    seq_len=cfg.model.seq_len,
                    data=cfg.train.data,
                )
                _record_work(tracer, batch)
                tokens = batch.tokens.to(device)
            # on a GPU the loss stays on the device: this step's kernels are queued before the
            # previous step's loss is read, so the host waits once per step, a step behind
            loss = engine.train_step_async(tokens, loss_weight)
            if pending is not None:
                _log_step(writer, *pending, end)
                pending = None
            step_ms = (time.perf_counter() - t0) * 1e3
            writer.rank_line(step, "step")
            if step == start:  # the optimizer's state exists from the first update on
                writer.memory(memory.rank_memory(engine))
            if rank == 0:
                pending = (step, loss, step_ms, step == start)
                if loss.device.type == "cpu":  # nothing to overlap: logged at once
                    _log_step(writer, *pending, end)
                    pending = None
            if saver.due(step + 1) or (step + 1 == end and saver.every > 0):
                saver.save(step + 1, engine.state_dict(live=True))  # copied once, in save
        if pending is not None:
            _log_step(writer, *pending, end)
            pending = None
        saver.close()
        engine.close()
    finally:
        if pending is not None:  # the step before a failure (best effort)
            with contextlib.suppress(Exception):
                _log_step(writer, *pending, end)
        if tracer is not None:
            tracer.close()
    return end - start


def _log_step(
    writer: progress.ProgressWriter,
    step: int,
    loss: torch.Tensor,
    step_ms: float,
    first: bool,
    end: int,
) -> None:
    """Rank 0's line of the loss log (reading ``loss`` waits for its step's kernels)."""
    value = float(loss)
    writer.step_record({"step": step, "loss": value, "step_ms": step_ms, "first": first})
    if step < 10 or step % 10 == 0 or step + 1 == end:
        log.info("step %d loss %.4f %.1f ms", step, value, step_ms)


def _setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"[rank {rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank (``python -m trainer.train RUN``, under torchrun); returns the exit
    status, 1 when training failed."""
    p = argparse.ArgumentParser(prog="python -m trainer.train")
    p.add_argument("run", help="run directory prepared by megascope train")
    p.add_argument(
        "--launch", help="the launcher's configuration (default RUN/.progress/launch.json)"
    )
    args = p.parse_args(argv)
    lifeline.die_with_parent(signal.SIGKILL)  # torchrun killed: nothing else would end this rank
    rank = int(os.environ.get("RANK", "0"))
    _setup_logging(rank)
    writer = progress.ProgressWriter(args.run, rank)
    writer.rank_line(-1, "start")
    launch = args.launch or os.path.join(progress.progress_dir(args.run), "launch.json")
    with open(launch, encoding="utf-8") as f:
        cfg = from_mapping(json.load(f))
    if cfg.train.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=2 * cfg.run.hang_timeout + 300)
    dist.init_process_group("nccl" if cfg.train.device == "cuda" else "gloo", timeout=timeout)
    code = 0
    try:
        train(cfg, rank, writer)
    except Exception:
        log.exception("training failed")
        code = 1
    finally:
        writer.close()  # the last lines, waited for a bounded time (a stalled disk is left)
        gc.collect()
        if code == 0:
            dist.destroy_process_group()
    return code


def _exit(code: int) -> None:
    """Leave at once once everything is flushed: with torch loaded, the interpreter's own
    finalization (a full garbage collection of every module) takes seconds on a busy machine,
    seconds during which torchrun and the launcher wait for nothing."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
