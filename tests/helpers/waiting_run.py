"""A recorded-style run in which one rank *waits* rather than computes, and the spans cover a
small part of each step (as torchtitan's FSDP2 loop records: its backward spans hold under a
tenth of the backward).

``write_waiting_run`` writes the SPEC §2 tables of a dp-only CPU run. Each step of each rank:
a data span, a forward of ``layers`` all-gathers each followed by a block's compute (all
inside one forward span), then per layer an untraced stretch of backward compute, a short
``backward`` span and a reduce-scatter, then an optimizer span; a ``step`` span holds it all
and carries the thread's CPU time (``cpu_ns``) and its wait for a core (``runq_ns``). A
collective ends at its last member's arrival plus a transfer. The slow rank's extra time lies
in the untraced backward stretches and is slept: its CPU time is its peers'. A *descheduled*
rank (``core_wait_rank``) takes as long there, but waiting for a core (its ``runq_ns`` holds the
extra), computing ``core_wait_cpu`` times its peers' (a pipelining schedule's rank the host ran
less reads a few percent more CPU time). Seeded jitter keeps the ranks' times apart as a real
run's are.
"""

from __future__ import annotations

import numpy as np

from helpers.small_run import MS, T0, PartsWriter, write_meta
from tracer.rundir import coords_of, write_part
from tracer.schema import TABLES

US = MS // 1000


def _empty(table: str) -> dict[str, list]:
    return {f.name: [] for f in TABLES[table]}


def _span(
    w: PartsWriter, r: int, step: int, name: str, kind: str, t0: int, t1: int, **extra
) -> None:
    row = dict(rank=r, step=step, microbatch=-1, name=name, kind=kind, start_ns=t0, end_ns=t1)
    row.update(source="host", **extra)
    cols = w.rows["spans"][r]
    for k in cols:
        cols[k].append(row.get(k))


def _collective(
    w: PartsWriter, t: dict[int, int], step: int, op: str, world: int, xfer: int
) -> None:
    """Every rank enters ``op`` over the whole world at ``t[r]``; all end together."""
    end = max(t.values()) + xfer
    for r in range(world):
        w.coll(r, step, op, "dp", world, -1, "dp", t[r], end, nbytes=MS)
        t[r] = end


def write_waiting_run(
    run: str,
    world: int = 4,
    steps: int = 8,
    slow_rank: int = -1,
    factor: float = 1.5,
    layers: int = 4,
    seed: int = 0,
    core_wait_rank: int = -1,
    core_wait_cpu: float = 1.03,
) -> str:
    """Write the run (see the module docstring); returns its path."""
    mesh = {"dp": world, "pp": 1, "tp": 1, "cp": 1}
    write_meta(run, mesh, "cpu", "finished", slow_rank, factor)
    w = PartsWriter(world)
    for r in range(world):
        topo = _empty("topology")
        row = dict(rank=r, host="node0", local_rank=r, pid=1000 + r, device="cpu",
                   gpu_uuid=None, clock_offset_ns=0, **coords_of(r, mesh))  # fmt: skip
        for k, v in row.items():
            topo[k].append(v)
        write_part(run, "topology", r, topo)
    rng = np.random.default_rng(seed)

    def jitter(ns: int) -> int:
        return int(ns * rng.uniform(0.95, 1.05))

    start = T0
    for step in range(steps):
        t = {r: start for r in range(world)}
        cpu = {r: 0 for r in range(world)}
        runq = {r: 0 for r in range(world)}  # the extra wait for a core (core_wait_rank)
        for r in range(world):
            d = jitter(MS)
            _span(w, r, step, "data", "data", t[r], t[r] + d)
            t[r] += d
            cpu[r] += d
        fwd0 = dict(t)
        for _ in range(layers):
            _collective(w, t, step, "all_gather", world, 300 * US)
            for r in range(world):
                d = jitter(2 * MS)
                t[r] += d
                cpu[r] += d
        for r in range(world):
            _span(w, r, step, "forward", "compute", fwd0[r], t[r])
        for _ in range(layers):
            for r in range(world):
                d = jitter(5 * MS)  # the backward's compute that no span records
                t[r] += int(d * factor) if r in (slow_rank, core_wait_rank) else d
                if r == core_wait_rank:  # runnable, waiting for a core, the extra time
                    runq[r] += int(d * factor) - int(d * core_wait_cpu)
                    d = int(d * core_wait_cpu)
                cpu[r] += d  # the slow rank sleeps its extra time
                b = jitter(400 * US)
                _span(w, r, step, "backward", "compute", t[r], t[r] + b)
                t[r] += b
                cpu[r] += b
            _collective(w, t, step, "reduce_scatter", world, 300 * US)
        for r in range(world):
            d = jitter(MS)
            _span(w, r, step, "optimizer", "compute", t[r], t[r] + d)
            t[r] += d
            cpu[r] += d
            _span(w, r, step, "step", "host", start, t[r], cpu_ns=cpu[r],
                  runq_ns=runq[r] + jitter(MS))  # fmt: skip
            hb = w.rows["heartbeats"][r]
            for k, v in dict(rank=r, ts_ns=start, step=step, state="step").items():
                hb[k].append(v)
        start = max(t.values()) + 200 * US
    w.flush(run)
    return run
