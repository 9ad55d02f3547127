"""A small run directory for the dashboard's tests, written through tracer.rundir.

``write_small_run`` writes the SPEC §2 tables of a dp x pp x tp run in which every rank
computes forward, tensor-parallel all-reduce, pipeline send/recv and a data-parallel
all-reduce per step. Times follow a simple phase model: a collective ends when the last
member of its group arrives plus a transfer time, so a slow rank makes its peers wait, as
on a real cluster. It exists so the dashboard tests do not depend on the simulator.
"""

from __future__ import annotations

import os
from collections import defaultdict

from tracer.rundir import base_run_json, coords_of, mesh_groups, write_json_atomic, write_part
from tracer.schema import TABLES

MS = 1_000_000
T0 = 1_700_000_000_000_000_000


def _empty(table: str) -> dict[str, list]:
    return {f.name: [] for f in TABLES[table]}


def _group_members(rank: int, axis: str, mesh: dict[str, int]) -> list[int]:
    for g in mesh_groups(mesh):
        if g["name"] == axis and rank in g["ranks"]:
            return g["ranks"]
    return [rank]


class PartsWriter:
    """Collects the rows of every rank; ``flush`` writes one part per (table, rank)."""

    def __init__(self, world: int) -> None:
        self.rows = {t: {r: _empty(t) for r in range(world)} for t in TABLES}
        self.seq: dict[tuple[int, str], int] = defaultdict(int)

    def span(self, r: int, step: int, name: str, kind: str, start: int, end: int) -> None:
        row = dict(rank=r, step=step, microbatch=-1, name=name, kind=kind, start_ns=start)
        row.update(end_ns=end, source="host")
        for k, v in row.items():
            self.rows["spans"][r][k].append(v)

    def coll(
        self,
        r: int,
        step: int,
        op: str,
        group: str,
        size: int,
        peer: int,
        key: str,
        issue: int,
        end: int | None,
        nbytes: int = 4 * MS,
    ) -> None:
        seq = self.seq[(r, key)]
        self.seq[(r, key)] += 1
        row = dict(rank=r, step=step, microbatch=-1, op=op, group=group, group_size=size)
        row.update(seq=seq, peer=peer, nbytes=nbytes, dtype="float32", issue_ns=issue)
        row.update(start_ns=issue, end_ns=end, source="host")
        for k, v in row.items():
            self.rows["collectives"][r][k].append(v)

    def flush(self, run: str) -> None:
        for table, by_rank in self.rows.items():
            for r, cols in by_rank.items():
                if cols["rank"]:
                    write_part(run, table, r, cols)
                    for v in cols.values():
                        v.clear()


def _sync(
    w: PartsWriter,
    t: dict[int, int],
    step: int,
    axis: str,
    mesh: dict[str, int],
    xfer: int,
    op: str = "all_reduce",
) -> None:
    """Every group of ``axis`` all-reduces: each member ends at the last arrival + xfer."""
    for r in sorted(t):
        members = _group_members(r, axis, mesh)
        if len(members) < 2:
            continue
        end = max(t[m] for m in members) + xfer
        w.coll(r, step, op, axis, len(members), -1, axis, t[r], end)
    ends = {r: max(t[m] for m in _group_members(r, axis, mesh)) + xfer for r in t}
    t.update({r: e for r, e in ends.items() if len(_group_members(r, axis, mesh)) > 1})


def write_meta(
    run: str, mesh: dict[str, int], device: str, status: str, slow_rank: int, factor: float
) -> None:
    """``RUN/run.json`` of a written run of ``mesh`` (the folder made), with its slow rank's
    injection where ``slow_rank`` >= 0."""
    os.makedirs(run, exist_ok=True)
    world = mesh["dp"] * mesh["pp"] * mesh["tp"] * mesh["cp"]
    meta = base_run_json(
        run_id=os.path.basename(run),
        world_size=world,
        mesh=mesh,
        groups=mesh_groups(mesh),
        device=device,
        status=status,
        injections=[f"slow_rank:rank={slow_rank},factor={factor}"] if slow_rank >= 0 else [],
    )
    write_json_atomic(os.path.join(run, "run.json"), meta)


def write_small_run(
    run: str,
    mesh: dict[str, int],
    steps: int = 6,
    slow_rank: int = -1,
    factor: float = 1.5,
    status: str = "finished",
    gpu: bool = True,
    first_step: int = 0,
) -> str:
    """Write (or extend, with ``first_step``) a run; returns its path."""
    mesh = {k: int(mesh.get(k, 1)) for k in ("dp", "pp", "tp", "cp")}
    world = mesh["dp"] * mesh["pp"] * mesh["tp"] * mesh["cp"]
    write_meta(run, mesh, "cuda" if gpu else "cpu", status, slow_rank, factor)
    w = PartsWriter(world)
    if first_step == 0:
        for r in range(world):
            c = coords_of(r, mesh)
            topo = _empty("topology")
            for k, v in dict(
                rank=r,
                host=f"node{r // 4}",
                local_rank=r % 4,
                pid=1000 + r,
                device="cuda",
                gpu_uuid=None,
                clock_offset_ns=0,
                **c,
            ).items():
                topo[k].append(v)
            write_part(run, "topology", r, topo)
    f = {r: (factor if r == slow_rank else 1.0) for r in range(world)}
    t0 = T0 + first_step * 100 * MS
    for step in range(first_step, first_step + steps):
        start = t0 + (step - first_step) * 100 * MS
        t = {r: start for r in range(world)}
        for r in range(world):
            w.span(r, step, "data", "data", t[r], t[r] + MS)
            t[r] += MS
        for stage in range(mesh["pp"]):
            ranks = [r for r in range(world) if coords_of(r, mesh)["pp"] == stage]
            for r in ranks:
                if stage > 0:
                    src = r - mesh["dp"] * mesh["cp"] * mesh["tp"]
                    end = max(t[r], t[src]) + MS
                    w.coll(r, step, "recv", "pp", 2, src, f"p2p{src}", t[r], end)
                    t[r] = end
                dur = int(10 * MS * f[r])
                w.span(r, step, "forward", "compute", t[r], t[r] + dur)
                t[r] += dur
            stage_t = {r: t[r] for r in ranks}
            _sync(w, stage_t, step, "tp", mesh, MS // 2)
            t.update(stage_t)
            for r in ranks:
                if stage < mesh["pp"] - 1:
                    dst = r + mesh["dp"] * mesh["cp"] * mesh["tp"]
                    w.coll(r, step, "send", "pp", 2, dst, f"p2p{dst}", t[r], t[r] + MS)
        for r in range(world):
            dur = int(20 * MS * f[r])
            w.span(r, step, "backward", "compute", t[r], t[r] + dur)
            t[r] += dur
        _sync(w, t, step, "dp", mesh, 2 * MS)
        for r in range(world):
            w.span(r, step, "optimizer", "compute", t[r], t[r] + 2 * MS)
            w.span(r, step, "step", "host", start, t[r] + 2 * MS)
            hb = w.rows["heartbeats"][r]
            for k, v in dict(rank=r, ts_ns=start, step=step, state="step").items():
                hb[k].append(v)
            if gpu:
                g = w.rows["gpu"][r]
                row = dict(
                    rank=r,
                    ts_ns=start + 50 * MS,
                    mem_clock_mhz=1593,
                    sm_clock_mhz=1200 if r == slow_rank else 1980,
                    power_w=400.0 + r,
                    temp_c=60.0 + (15 if r == slow_rank else 0),
                    util_gpu=90.0,
                    mem_used_bytes=10**9,
                    throttle_reasons=0,
                    pcie_tx_bps=1e9,
                    pcie_rx_bps=1e9,
                    ecc_errors=0,
                )
                for k, v in row.items():
                    g[k].append(v)
    w.flush(run)
    return run
