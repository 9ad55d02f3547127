"""A small, exact cluster model that writes SPEC run directories for the analyzer's tests.

Each rank runs a fixed program per step (data, a GPipe-style pipeline of forward and backward
microbatches with a tensor-parallel all-reduce after each, point-to-point sends between stages,
a data-parallel all-reduce, the optimizer). Collectives block until every member has arrived and
finish ``transfer`` later; so a slow rank makes its peers wait, exactly as on a real cluster.
Faults follow SPEC §5. Everything is written through ``tracer.rundir.write_part``.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field

from tracer.rundir import base_run_json, coords_of, mesh_groups, rank_of, write_json_atomic
from tracer.rundir import write_part as _write_part
from tracer.schema import TABLES

MS = 1_000_000
T0 = 1_700_000_000_000_000_000


@dataclass
class World:
    dp: int = 2
    pp: int = 2
    tp: int = 2
    steps: int = 12
    microbatches: int = 3
    fwd_ms: float = 10.0
    data_ms: float = 2.0
    noise: float = 0.03
    link_gbps: float = 10.0
    tp_bytes: int = 4 << 20
    pp_bytes: int = 2 << 20
    dp_bytes: int = 32 << 20
    seed: int = 0
    slow_rank: dict[int, float] = field(default_factory=dict)
    slow_link: tuple[int, int, float] | None = None
    pause: tuple[int, int, float] | None = None  # rank, every, ms
    slow_data: tuple[int, float] | None = None  # rank, ms
    hang: tuple[int, int] | None = None  # rank, step
    crash: tuple[int, int] | None = None  # rank, step
    stage_factor: dict[int, float] = field(default_factory=dict)
    drift: float = 0.0  # step time grows by this fraction per step
    throttle: dict[int, int] = field(default_factory=dict)  # rank -> sm clock MHz
    capped: float = 0.0  # every GPU power-capped in this share of its samples
    injections: list[str] = field(default_factory=list)
    # host-timed CPU runs: spans count their CPU time (cpu_ns), the work itself with this
    # noise (None: not counted); ``slow_sleeps``: the slow ranks' extra time is a sleep, which
    # takes no CPU, not extra compute
    cpu_noise: float | None = None
    slow_sleeps: bool = False
    # with slow_sleeps: a slow rank's CPU time over its peers' for the same work (a rank that
    # sleeps but also computes a little more, as the trainer's sleeping slow_rank reads: 1.1)
    slow_cpu: dict[int, float] = field(default_factory=dict)
    # with cpu_noise: spans also record their wait for a core (runq_ns): every rank waits
    # ``runq_share`` of its work's time; a ``descheduled`` rank's compute takes this factor
    # longer, all of it waiting for a core (its work and CPU time its peers')
    record_runq: bool = False
    ranks_per_host: int = 4
    runq_share: float = 0.3
    descheduled: dict[int, float] = field(default_factory=dict)

    @property
    def mesh(self) -> dict[str, int]:
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp, "cp": 1}

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp


class _Sim:
    """The rank programs and the blocking rules (see the module docstring)."""

    def __init__(self, w: World) -> None:
        self.w = w
        self.rng = random.Random(w.seed)
        self.clock = {r: T0 + self.rng.randrange(0, 200_000) for r in range(w.world)}
        self.spans: dict[int, list[tuple]] = defaultdict(list)
        self.cpu: dict[int, int] = defaultdict(int)  # CPU ns each rank's compute took so far
        self.runq: dict[int, int] = defaultdict(int)  # and the ns it waited for a core
        self.colls: dict[int, list[tuple]] = defaultdict(list)
        self.beats: dict[int, list[tuple]] = defaultdict(list)
        self.pending: dict[tuple, dict[int, tuple]] = {}
        self.seq: dict[tuple, int] = defaultdict(int)
        self.group_of: dict[tuple[str, int], list[int]] = {}
        for g in mesh_groups(w.mesh):
            for r in g["ranks"]:
                self.group_of[(g["name"], r)] = g["ranks"]

    def jitter(self) -> float:
        return self.rng.lognormvariate(0.0, self.w.noise)

    def compute(self, r: int, step: int, mb: int, name: str, ms: float) -> None:
        c = coords_of(r, self.w.mesh)
        work = ms * self.w.stage_factor.get(c["pp"], 1.0) * (1.0 + self.w.drift * step)
        ms = work * self.w.slow_rank.get(r, 1.0)
        waited = work * (self.w.descheduled.get(r, 1.0) - 1.0)
        dur = int((ms + waited) * MS * self.jitter())
        cpu = runq = None
        if self.w.cpu_noise is not None:
            burnt = work * self.w.slow_cpu.get(r, 1.0) if self.w.slow_sleeps else ms
            cpu = int(burnt * MS * self.rng.lognormvariate(0.0, self.w.cpu_noise))
            self.cpu[r] += cpu
            if self.w.record_runq:  # a sleep waits for no core
                queued = burnt * self.w.runq_share + waited
                runq = int(queued * MS * self.rng.lognormvariate(0.0, self.w.cpu_noise))
                self.runq[r] += runq
        start = self.clock[r]
        self.spans[r].append((step, mb, name, "compute", start, start + dur, cpu, runq))
        self.clock[r] += dur

    def transfer_ns(self, members: list[int], nbytes: int, factor: float) -> int:
        sl = self.w.slow_link
        if sl and sl[0] in members and sl[1] in members:
            factor *= sl[2]
        seconds = nbytes * factor / (self.w.link_gbps * 1e9)
        return int((20_000 + seconds * 1e9) * self.jitter())

    def program(self, r: int):
        """Yield the rank's ops: ('span', ...) run at once; ('coll', key, ...) block."""
        w = self.w
        c = coords_of(r, w.mesh)
        last = w.pp - 1
        for step in range(w.steps):
            yield ("beat", step)
            if w.hang and w.hang == (r, step) or w.crash and w.crash == (r, step):
                yield ("stop", step)
                return
            s0, c0, q0 = self.clock[r], self.cpu[r], self.runq[r]
            extra = w.slow_data[1] if w.slow_data and w.slow_data[0] == r else 0.0
            dur = int((w.data_ms + extra) * MS * self.jitter())
            self.spans[r].append((step, -1, "data", "data", s0, s0 + dur, None, None))
            self.clock[r] += dur
            if w.pause and w.pause[0] == r and step % w.pause[1] == w.pause[1] - 1:
                self.clock[r] += int(w.pause[2] * MS)
            for mb in range(w.microbatches):
                if c["pp"] > 0:
                    yield ("p2p", step, mb, rank_of({**c, "pp": c["pp"] - 1}, w.mesh), r)
                self.compute(r, step, mb, "forward", w.fwd_ms)
                if w.tp > 1:
                    yield ("coll", step, mb, "tp", "all_reduce", w.tp_bytes)
                if c["pp"] < last:
                    yield ("p2p", step, mb, r, rank_of({**c, "pp": c["pp"] + 1}, w.mesh))
            for mb in range(w.microbatches):
                if c["pp"] < last:
                    yield ("p2p", step, mb, rank_of({**c, "pp": c["pp"] + 1}, w.mesh), r)
                self.compute(r, step, mb, "backward", 2 * w.fwd_ms)
                if w.tp > 1:
                    yield ("coll", step, mb, "tp", "all_reduce", w.tp_bytes)
                if c["pp"] > 0:
                    yield ("p2p", step, mb, r, rank_of({**c, "pp": c["pp"] - 1}, w.mesh))
            if w.dp > 1:
                yield ("coll", step, -1, "dp", "all_reduce", w.dp_bytes)
            self.compute(r, step, -1, "optimizer", w.fwd_ms / 2)
            cpu = self.cpu[r] - c0 if w.cpu_noise is not None else None
            runq = self.runq[r] - q0 if w.cpu_noise is not None and w.record_runq else None
            self.spans[r].append((step, -1, "step", "host", s0, self.clock[r], cpu, runq))


def _arrive(sim: _Sim, r: int, op: tuple) -> tuple[tuple, list[int], dict]:
    """Register rank r's arrival at a blocking op; return (key, members, row fields)."""
    w = sim.w
    if op[0] == "p2p":
        _, step, mb, src, dst = op
        seq_key = ("pp", src, dst)
        members = [src, dst]
        kind = "send" if r == src else "recv"
        peer = dst if r == src else src
        key = ("p2p", src, dst, sim.seq[(r, *seq_key)])
        sim.seq[(r, *seq_key)] += 1
        fields = dict(step=step, mb=mb, op=kind, group="pp", size=2, peer=peer, nbytes=w.pp_bytes)
    else:
        _, step, mb, name, kind, nbytes = op
        members = sim.group_of[(name, r)]
        seq = sim.seq[(r, name)]
        sim.seq[(r, name)] += 1
        key = (name, tuple(members), seq)
        fields = dict(
            step=step, mb=mb, op=kind, group=name, size=len(members), peer=-1, nbytes=nbytes
        )
    fields["seq"] = key[-1]
    fields["issue"] = sim.clock[r]
    return key, members, fields


def simulate(w: World) -> _Sim:
    sim = _Sim(w)
    progs = {r: sim.program(r) for r in range(w.world)}
    waiting: dict[int, tuple] = {}
    stopped: set[int] = set()
    runnable = list(range(w.world))
    while runnable:
        r = runnable.pop(0)
        for op in progs[r]:
            if op[0] == "beat":
                sim.beats[r].append((sim.clock[r], op[1], "step"))
                continue
            if op[0] == "stop":
                stopped.add(r)
                break
            key, members, fields = _arrive(sim, r, op)
            sim.pending.setdefault(key, {})[r] = fields
            waiting[r] = key
            arrived = sim.pending[key]
            if len(arrived) < len(members):
                break
            factor = 2.0 * (len(members) - 1) / len(members) if op[0] == "coll" else 1.0
            end = max(f["issue"] for f in arrived.values())
            end += sim.transfer_ns(members, fields["nbytes"], factor)
            for m, f in arrived.items():
                e = end + int(self_noise(sim))
                sim.colls[m].append((f, e))
                sim.clock[m] = e
                waiting.pop(m, None)
                if m != r:
                    runnable.append(m)
            del sim.pending[key]
    for arrived in sim.pending.values():
        for m, f in arrived.items():
            sim.colls[m].append((f, None))
    sim.stopped = stopped  # type: ignore[attr-defined]
    return sim


def self_noise(sim: _Sim) -> float:
    return sim.rng.randrange(0, 20_000)


def write_part(run_dir: str, table: str, rank: int, rows: list[dict]) -> None:
    cols = {f.name: [row.get(f.name) for row in rows] for f in TABLES[table]}
    _write_part(run_dir, table, rank, cols)


def write_world(w: World, run_dir: str) -> dict:
    """Simulate ``w`` and write its run directory; return run.json."""
    sim = simulate(w)
    meta = base_run_json(
        world_size=w.world, mesh=w.mesh, groups=mesh_groups(w.mesh), injections=w.injections
    )
    crash_rank = w.crash[0] if w.crash else None
    for r in range(w.world):
        c = coords_of(r, w.mesh)
        lost_from = w.crash[1] - 1 if r == crash_rank else None
        keep = lambda step, lf=lost_from: lf is None or step < lf  # noqa: E731
        topo = dict(
            rank=r,
            host=f"node{r // w.ranks_per_host}",
            local_rank=r % w.ranks_per_host,
            pid=1000 + r,
            device="cpu",
        )
        write_part(run_dir, "topology", r, [{**topo, **c, "clock_offset_ns": 0}])
        spans = [
            dict(rank=r, step=s, microbatch=mb, name=n, kind=k, start_ns=a, end_ns=b,
                 source="host", cpu_ns=cpu, runq_ns=runq)
            for (s, mb, n, k, a, b, cpu, runq) in sim.spans[r]
            if keep(s)
        ]  # fmt: skip
        colls = [
            dict(
                rank=r,
                step=f["step"],
                microbatch=f["mb"],
                op=f["op"],
                group=f["group"],
                group_size=f["size"],
                seq=f["seq"],
                peer=f["peer"],
                nbytes=f["nbytes"],
                dtype="float32",
                issue_ns=f["issue"],
                start_ns=f["issue"],
                end_ns=e,
                source="host",
            )
            for f, e in sim.colls[r]
            if keep(f["step"])
        ]
        beats = [dict(rank=r, ts_ns=t, step=s, state=st) for t, s, st in sim.beats[r] if keep(s)]
        half = len(spans) // 2
        for chunk in (spans[:half], spans[half:]):
            if chunk:
                write_part(run_dir, "spans", r, chunk)
        if colls:
            write_part(run_dir, "collectives", r, colls)
        if beats:
            write_part(run_dir, "heartbeats", r, beats)
        if w.throttle or w.capped:
            clock = w.throttle.get(r, 1980)
            cap = [i < round(20 * w.capped) for i in range(20)]  # its first samples capped
            gpu = [
                dict(
                    rank=r,
                    ts_ns=T0 + i * 100 * MS,
                    sm_clock_mhz=1755 if cap[i] else clock,
                    mem_clock_mhz=2619,
                    power_w=700.0 if cap[i] else 300.0,
                    temp_c=90.0 if r in w.throttle else 60.0,
                    util_gpu=95.0,
                    mem_used_bytes=1 << 34,
                    throttle_reasons=(0x20 if r in w.throttle else 0) | (0x4 if cap[i] else 0),
                    pcie_tx_bps=0.0,
                    pcie_rx_bps=0.0,
                    ecc_errors=0,
                )
                for i in range(20)
            ]
            write_part(run_dir, "gpu", r, gpu)
    if w.hang:
        write_part(
            run_dir,
            "stacks",
            w.hang[0],
            [
                dict(
                    rank=w.hang[0],
                    ts_ns=T0,
                    reason="hang",
                    thread="MainThread",
                    stack="train_step (trainer/engine.py:88)\nstuck_forever (trainer/faults.py:41)",
                )
            ],
        )
    meta["status"] = "hung" if w.hang else "failed" if w.crash else "finished"
    meta["summary"] = {"steps": w.steps}
    write_json_atomic(f"{run_dir}/run.json", meta)
    return meta
