"""Collectives no wrapper sees, read from Flight Recorder: functional collectives (what DTensor
and tensor parallelism issue) mixed with the wrappers' own and with send/recv on the same
group, more of them between two flushes than the ring holds, each recorded once with one
numbering on every rank. The tracer's own timing of eager functional collectives is off here
(``funcol_waits``), so that they reach the tracer only through Flight Recorder."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from helpers.tables import read

import tracer
from tracer.config import TracerConfig
from tracer.flight import fr_op

# the functional collectives left to Flight Recorder, as a compiled graph's are (eager ones are
# timed on the host by default: tests/test_funcol_live.py)
FR_ONLY = {"funcol_waits": False}
RING = 300  # entries: the test overflows a small ring unless the tracer reads in time
STEPS, PER_STEP = 30, 20


def _mixed(rank: int, world: int, run: str) -> dict:
    cfg = TracerConfig(hang_timeout_s=0, flush_every_s=600, flush_every_steps=1000, **FR_ONLY)
    tr = tracer.attach(run, config=cfg, auto=False)
    group = dist.new_group([0, 1], group_desc="tp")
    t = torch.ones(4)
    for step in range(STEPS):
        tracer.step(step)
        for _ in range(PER_STEP):
            funcol.all_reduce(t, "sum", group).wait()  # Flight Recorder only
        dist.all_reduce(t, group=group)  # the wrappers (and Flight Recorder)
        # send/recv on the same group: gloo's group counter counts them, Flight Recorder not
        if rank == 0:
            dist.send(t, 1, group=group)
            dist.recv(t, 1, group=group)
        else:
            dist.recv(t, 0, group=group)
            dist.send(t, 0, group=group)
    tracer.close()
    return {"dropped": tr.recorder.flight.dropped}


def test_flight_recorder_rows_once_each_without_losing_the_ring(tmp_path, monkeypatch, ranks):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", str(RING))  # before the ranks' groups exist
    run = str(tmp_path / "run")
    assert ranks(_mixed, 2, run) == [{"dropped": 0}] * 2
    rows = read(run, "collectives", "\"group\" = 'tp' and peer < 0")
    for rank in (0, 1):
        mine = [r for r in rows if r["rank"] == rank]
        seqs = [r["seq"] for r in mine]
        assert sorted(seqs) == list(range(1, STEPS * (PER_STEP + 1) + 1))  # none twice or lost
        by_source = {s: sum(r["source"] == s for r in mine) for s in ("host", "untimed")}
        assert by_source == {"host": STEPS, "untimed": STEPS * PER_STEP}
        assert {r["step"] for r in mine} == set(range(STEPS))
        assert all(r["op"] == "all_reduce" and r["nbytes"] == 16 for r in mine)
    # the same seq is the same collective on both members
    keys = {(r["rank"], r["seq"], r["source"]) for r in rows}
    assert {(1, s, src) for _, s, src in keys if _ == 0} == {k for k in keys if k[0] == 1}


def test_flight_recorder_names_map_to_spec_ops():
    names = {
        "nccl:all_reduce": "all_reduce", "gloo:allreduce": "all_reduce",
        "nccl:_allgather_base": "all_gather", "nccl:all_gather_into_tensor_coalesced": "all_gather",
        "nccl:_reduce_scatter_base": "reduce_scatter", "nccl:alltoall_base": "all_to_all",
        "nccl:all_to_all": "all_to_all", "gloo:broadcast": "broadcast", "nccl:send 0->1": "send",
        "nccl:recv 1<-0": "recv", "gloo:barrier": "barrier", "nccl:reduce": "reduce",
    }  # fmt: skip
    assert {n: fr_op(n) for n in names} == names


def _overflow(rank: int, world: int, run: str) -> dict:
    cfg = TracerConfig(hang_timeout_s=0, flush_every_s=600, flush_every_steps=1000, **FR_ONLY)
    tr = tracer.attach(run, config=cfg, auto=False)
    group = dist.new_group([0, 1], group_desc="tp")
    t = torch.ones(4)
    tracer.step(0)
    for _ in range(3 * RING):  # three rings' worth in one step: no flush comes in time
        funcol.all_reduce(t, "sum", group).wait()
    tracer.close()
    return {"dropped": tr.recorder.flight.dropped}


def test_entries_the_ring_lost_are_counted_in_run_json(tmp_path, monkeypatch, ranks):
    from analyzer.findings import dropped
    from tracer import rundir

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", str(RING))
    run = str(tmp_path / "run")
    lost = 2 * RING
    assert ranks(_overflow, 2, run) == [{"dropped": lost}] * 2
    rows = read(run, "collectives", "\"group\" = 'tp'")
    assert len(rows) == 2 * RING  # what the ring still held, on each of the two ranks
    meta = rundir.read_run_json(run)
    assert meta["dropped"] == {str(r): {"flight_recorder_entries": lost} for r in (0, 1)}
    note = dropped.note(meta)
    assert note["ranks"] == [0, 1] and f"{2 * lost:,} flight_recorder_entries" in note["message"]
