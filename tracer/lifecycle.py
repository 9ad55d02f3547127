"""A tracer's first and last writes: its topology row and, on rank 0 of a script's own run, run.json
at attach; and the work of close, in the order that keeps what matters most (the last rows on
disk, what was dropped, then run.json's status and summary)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any

from tracer import hwclass, rundir
from tracer.clock import now_ns
from tracer.core import Tracer

log = logging.getLogger(__name__)


def write_topology_and_run_json(tr: Tracer, world_name: str | None) -> None:
    """At attach: read the device's name, memory, uuid and hardware class, write this rank's
    topology row, and on rank 0 write run.json when none exists (the script's own run)."""
    handle, name, mem = None, None, None
    if tr.device == "cuda":
        from tracer import nvml

        try:
            import torch

            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            name, mem = str(props.name), int(props.total_memory)
            handle = nvml.open_device(torch.cuda.current_device())
            tr.gpu_uuid = nvml.gpu_uuid(handle) if handle is not None else None
        except Exception:
            tr.gpu_uuid = None
    try:
        tr.hw = hwclass.describe(tr.device, handle=handle, device_name=name, device_mem_bytes=mem)
    except Exception as exc:  # its class unknown (null), the run traced all the same
        log.info("megascope: hardware class not read (%s)", exc)
    tr.writer.write("topology", _columns("topology", tr, [tr.topology_row()]))
    path = os.path.join(tr.run_dir, "run.json")
    if tr.rank == 0 and not os.path.exists(path):
        import torch

        meta = rundir.base_run_json(
            world_size=tr.world,
            mesh=tr.mesh,
            groups=(
                [{"name": world_name, "ranks": list(range(tr.world))}]
                if world_name
                else rundir.mesh_groups(tr.mesh)
            ),
            device=tr.device,
            tracer=tr.config.as_dict(),
            versions={"torch": torch.__version__, "cuda": torch.version.cuda},
        )
        rundir.write_json_atomic(path, meta)
        rundir.reserve_status(tr.run_dir)
        tr.owns_run_json = True


def _columns(table: str, tr: Tracer, rows: list[tuple[Any, ...]]) -> dict[str, list[Any]]:
    from tracer.writer import to_columns

    return to_columns(table, rows, tr.rank, tr.offset_ns, None)[0]


def exit_status() -> str:
    """The status close writes by default: "failed" after an uncaught exception, else "finished"."""
    failed = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return "failed" if failed is not None else "finished"


def finish(tr: Tracer, status: str) -> None:
    """The work of close: what matters most (the last rows on disk) comes first."""
    if tr.hung and status == "failed":
        # A hang recorded first stays the diagnosis: the error that ends a hung run (a peer
        # exits, gloo closes the connection, the main thread raises) is its consequence.
        status = "hung"
    inflight: list[tuple[Any, ...]] = []
    for part in (tr.auto, tr.groups):
        if part is not None:
            with contextlib.suppress(Exception):
                part.uninstall()
    for undo in tr.restore:
        with contextlib.suppress(Exception):
            undo()
    if tr.recorder is not None:
        inflight = tr.recorder.inflight_rows()
        tr.recorder.uninstall()
    if tr.enabled:
        try:
            tr.end_step()
            tr.buffers["heartbeats"].add((now_ns(), tr.step_no, "end"))
            tr.flush(final=True, extra={"collectives": inflight})
            tr.record_drops()
            tr.record_cpu()
        except Exception as e:
            tr.fail(e, "closing")
    if tr.owns_run_json and tr.writing:
        tr.update_run_json(
            status=status,
            ended_at=rundir.now_iso(),
            summary=summary(tr),
        )
    elif tr.owns_run_json and tr.storage_failure is not None:  # run.json's disk failed
        rundir.write_reserved(
            tr.run_dir,
            {"status": status, "ended_at": rundir.now_iso(),
             "storage_failed": [tr.storage_failure.as_dict()]},
        )  # fmt: skip
    tr.enabled = False
    for thread in (tr.watchdog, tr.sampler, tr.flusher):
        if thread is not None:
            with contextlib.suppress(Exception):
                thread.stop()
    tr.join_clock(2.0)


def summary(tr: Tracer) -> dict[str, Any]:
    """run.json's ``summary``: steps seen, rows written and, where it was read, Flight Recorder's
    reading and its cost."""
    out: dict[str, Any] = {"steps": tr.steps_seen, "rows": tr.writer.rows_written}
    flight = tr.recorder.flight if tr.recorder is not None else None
    if flight is not None:  # this rank's (rank 0's) reading of Flight Recorder, and its cost
        out["flight_recorder"] = {"rows": flight.rows_read, "reads": flight.reads,
                                  "read_s": round(flight.read_s, 4), "lost": flight.dropped,
                                  "timed": flight.timed, "rings": [r.name for r in flight.rings]}  # fmt: skip
    return out
