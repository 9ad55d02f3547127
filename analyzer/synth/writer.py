"""Writing the simulated run: one Parquet part per rank, table and chunk of steps.

Each rank writes only its own folder (``TABLE/rank=RRRRR/``) through
:func:`tracer.rundir.write_part`, like a real rank's tracer. The simulator buffers a chunk of
steps in memory and writes each rank's part of each table once per chunk, so a 12,288-rank run
of 50 steps becomes one file per rank and table rather than one per step.

Heartbeats and GPU samples are derived from the ``step`` spans: a heartbeat as each step
begins, one NVML-like sample in the middle of each completed step.
"""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analyzer.synth.cluster import GPUS_PER_HOST
from analyzer.synth.config import HwClassRange
from analyzer.synth.record import StageTables, rank_collectives, rank_spans
from analyzer.synth.work import WorkChunk
from tracer.rundir import coords_of, write_part
from tracer.schema import OPTIONAL, TABLES

THROTTLE_HW_SLOWDOWN = 0x8 | 0x40  # NVML: HW slowdown + HW thermal slowdown
SM_CLOCK_MHZ = 1980


@dataclass
class Waiting:
    """What a stuck rank was doing when the run was stopped (for its stack)."""

    op: str
    group: str
    seq: int
    step: int


@dataclass
class WriteState:
    """What the writer learns while writing: each rank's latest event, who waits in what."""

    last_ns: dict[int, int] = field(default_factory=dict)
    last_step: dict[int, int] = field(default_factory=dict)
    waiting: dict[int, Waiting] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)  # rows written per table
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def wrote(self, table: str, n: int) -> None:
        """Count ``n`` rows written to ``table`` (thread-safe)."""
        with self._lock:
            self.rows[table] = self.rows.get(table, 0) + n


def host_name(rank: int, hosts: tuple[str, ...] = ()) -> str:
    """The rank's host: ``hosts[rank // 8]`` (``synth --hosts``), else ``node<rank // 8>``."""
    return hosts[rank // GPUS_PER_HOST] if hosts else f"node{rank // GPUS_PER_HOST}"


def topology_columns(
    mesh: dict[str, int],
    ranks: range,
    hosts: tuple[str, ...] = (),
    classes: tuple[HwClassRange, ...] = (),
) -> dict[str, pa.Array]:
    """Topology rows of ``ranks``: simulated hosts of 8 GPUs, clocks already aligned (offset 0).
    A GPU's uuid follows its host and slot where ``hosts`` are named (jobs share machines);
    ``hw_class`` is the name of the ``classes`` range that holds the rank (null outside them),
    the other hardware columns null (nothing measured)."""
    cols: dict[str, list] = {f.name: [] for f in TABLES["topology"]}
    hw: list[str | None] = [None] * len(ranks)
    for hc in classes:
        for r in range(max(hc.first, ranks.start), min(hc.last + 1, ranks.stop)):
            hw[r - ranks.start] = hc.name
    cols["hw_class"] = hw
    for name in OPTIONAL["topology"]:
        if name != "hw_class":
            cols[name] = [None] * len(ranks)
    for r in ranks:
        c = coords_of(r, mesh)
        gpu = f"{host_name(r, hosts)}-gpu{r % GPUS_PER_HOST}" if hosts else f"gpu-{r}"
        uuid = hashlib.sha1(gpu.encode()).hexdigest()
        cols["rank"].append(r)
        cols["host"].append(host_name(r, hosts))
        cols["local_rank"].append(r % GPUS_PER_HOST)
        cols["pid"].append(10000 + r)
        cols["device"].append(f"cuda:{r % GPUS_PER_HOST}")
        cols["gpu_uuid"].append(
            f"GPU-{uuid[:8]}-{uuid[8:12]}-{uuid[12:16]}-{uuid[16:20]}-{uuid[20:32]}"
        )
        for k in ("dp", "pp", "tp", "cp"):
            cols[k].append(c[k])
        cols["clock_offset_ns"].append(0)
    return {f.name: pa.array(cols[f.name], type=f.type) for f in TABLES["topology"]}


def write_topology(
    run_dir: str,
    mesh: dict[str, int],
    world: int,
    state: WriteState,
    hosts: tuple[str, ...] = (),
    classes: tuple[HwClassRange, ...] = (),
) -> None:
    """One row per rank, one part per rank (:func:`topology_columns`)."""
    for r in range(world):
        cols = topology_columns(mesh, range(r, r + 1), hosts, classes)
        write_part(run_dir, "topology", r, cols, part=0)
    state.wrote("topology", world)


def _heartbeats(spans: pa.Table, rank: int) -> pa.Table:
    steps = spans.filter(pc.equal(spans["name"], "step"))
    n = steps.num_rows
    cols = {
        "rank": pa.array(np.full(n, rank, dtype=np.int32)),
        "ts_ns": steps["start_ns"],
        "step": steps["step"],
        "state": pa.array(["step"] * n, type=pa.string()),
    }
    schema = TABLES["heartbeats"]
    return pa.Table.from_arrays([cols[f.name] for f in schema], schema=schema)


def gpu_noise(rng: np.random.Generator, n: int) -> tuple[np.ndarray, ...]:
    """A rank's ``n`` GPU samples' noise, drawn in the one order both layouts use (the per-rank
    writer here, :mod:`analyzer.synth.ranges`): SM clock, power, temperature, PCIe tx, rx."""
    return (rng.uniform(0, 15, n), rng.normal(0, 12, n), rng.normal(0, 1.5, n),
            rng.uniform(1e9, 2e9, n), rng.uniform(1e9, 2e9, n))  # fmt: skip


def gpu_table(
    rank: np.ndarray, ts: np.ndarray, factor: np.ndarray, noise: tuple[np.ndarray, ...]
) -> pa.Table:
    """The ``gpu`` rows of samples at ``ts`` of ranks ``rank``: a throttled GPU (``factor`` >
    1) shows lower SM clocks by its factor, HW-slowdown reasons, a hot die and lower power;
    ``noise`` is :func:`gpu_noise`'s, sample by sample."""
    sm, power, temp, tx, rx = noise
    total = len(ts)
    hot = factor > 1.0
    cols = {
        "rank": rank.astype(np.int32),
        "ts_ns": ts,
        "sm_clock_mhz": np.rint(SM_CLOCK_MHZ / factor - sm).astype(np.int32),
        "mem_clock_mhz": np.full(total, 2619, dtype=np.int32),
        "power_w": (np.where(hot, 430.0, 640.0) + power).astype(np.float32),
        "temp_c": (np.where(hot, 89.0, 63.0) + temp).astype(np.float32),
        "util_gpu": np.full(total, 97.0, dtype=np.float32),
        "mem_used_bytes": np.full(total, 61_000_000_000, dtype=np.int64),
        "throttle_reasons": np.where(hot, THROTTLE_HW_SLOWDOWN, 0).astype(np.int64),
        "pcie_tx_bps": tx,
        "pcie_rx_bps": rx,
        "ecc_errors": np.zeros(total, dtype=np.int64),
    }
    schema = TABLES["gpu"]
    return pa.Table.from_arrays(
        [pa.array(cols[f.name], type=f.type) for f in schema], schema=schema
    )


def _gpu(
    spans: pa.Table, rank: int, throttle: list[tuple[float, int]], rng: np.random.Generator
) -> pa.Table:
    """One sample per completed step, mid-step, of a GPU throttled by ``throttle`` (factor,
    from step) (:func:`gpu_table`)."""
    steps = spans.filter(pc.equal(spans["name"], "step"))
    steps = steps.filter(pc.and_(pc.is_valid(steps["start_ns"]), pc.is_valid(steps["end_ns"])))
    step = steps["step"].to_numpy()
    start = steps["start_ns"].to_numpy()
    ts = start + (steps["end_ns"].to_numpy() - start) // 2
    n = len(ts)
    factor = np.ones(n)
    for f, from_step in throttle:
        factor = np.where(step >= from_step, factor * f, factor)
    return gpu_table(np.full(n, rank, dtype=np.int32), ts, factor, gpu_noise(rng, n))


def _note_waiting(coll: pa.Table, rank: int, state: WriteState) -> None:
    """Remember the blocking collective of a rank that has rows with a null end."""
    if coll["end_ns"].null_count == 0:
        return
    open_rows = coll.filter(pc.is_null(coll["end_ns"]))
    blocking = open_rows.filter(pc.not_equal(open_rows["op"], "send"))  # sends do not block
    open_rows = blocking if blocking.num_rows else open_rows
    last = int(np.argmax(open_rows["issue_ns"].to_numpy()))
    row = {k: open_rows[k][last].as_py() for k in ("op", "group", "seq", "step")}
    state.waiting[rank] = Waiting(**row)


@dataclass(frozen=True)
class ChunkJob:
    """One chunk's write order: the run, the part number, per-rank row filters and GPUs."""

    run_dir: str
    part: int
    base_ns: int
    keep_before: dict[int, int]  # rank -> first step whose rows are lost (crash)
    throttle: dict[int, list[tuple[float, int]]]
    gpu: bool
    seed: int
    jobs: int = 2
    work: WorkChunk | None = None  # the chunk's work rows (analyzer.synth.work)


def _write_rank(job: ChunkJob, st: StageTables, j: int, rank: int, state: WriteState) -> None:
    lost = job.keep_before.get(rank)
    span_keep = None if lost is None else st.span_cols["step"].to_numpy() < lost
    coll_keep = None if lost is None else st.coll_cols["step"].to_numpy() < lost
    spans = rank_spans(st, j, rank, job.base_ns, span_keep)
    coll = rank_collectives(st, j, rank, job.base_ns, coll_keep)
    beats = _heartbeats(spans, rank)
    write_part(job.run_dir, "spans", rank, spans, part=job.part)
    write_part(job.run_dir, "collectives", rank, coll, part=job.part)
    write_part(job.run_dir, "heartbeats", rank, beats, part=job.part)
    for table, data in (("spans", spans), ("collectives", coll), ("heartbeats", beats)):
        state.wrote(table, data.num_rows)
    if job.gpu:
        rng = np.random.default_rng([job.seed, rank, job.part])
        gpu = _gpu(spans, rank, job.throttle.get(rank, []), rng)
        write_part(job.run_dir, "gpu", rank, gpu, part=job.part)
        state.wrote("gpu", gpu.num_rows)
    if job.work is not None:
        lost_at = None if lost is None else np.array([lost])
        work = job.work.table(rank - j, np.array([j]), lost_at)
        write_part(job.run_dir, "work", rank, work.cast(TABLES["work"]), part=job.part)
        state.wrote("work", work.num_rows)
    _note_waiting(coll, rank, state)
    times = [pc.max(t).as_py() for t in (spans["start_ns"], spans["end_ns"], coll["end_ns"])]
    latest = max((t for t in times if t is not None), default=None)
    if latest is not None and latest > state.last_ns.get(rank, 0):
        state.last_ns[rank] = latest
    last_step = pc.max(spans["step"]).as_py()
    if last_step is not None:
        state.last_step[rank] = last_step


def write_stage(job: ChunkJob, st: StageTables, first_rank: int, state: WriteState) -> None:
    """Write every rank of one stage for one chunk of steps, ``job.jobs`` ranks at a time.

    Each rank touches only its own keys of ``state`` and its own folders, so the threads
    share nothing but the read-only stage tables.
    """
    ranks = range(st.span_times[0].shape[0])
    if job.jobs <= 1:
        for j in ranks:
            _write_rank(job, st, j, first_rank + j, state)
        return
    with ThreadPoolExecutor(max_workers=job.jobs) as pool:
        for f in [pool.submit(_write_rank, job, st, j, first_rank + j, state) for j in ranks]:
            f.result()


HANG_THREAD = '0x7f3a2c1b4740 (idle): "MainThread"'
TAIL = [
    "train_step (trainer/engine.py:212)",
    "run (trainer/train.py:141)",
    "<module> (trainer/train.py:230)",
]


def stack_frames(rank: int, hung: set[int], state: WriteState) -> list[str]:
    """The stack a stuck rank's dump shows, innermost first: a hung rank (or one waiting in nothing)
    in its compute, the others in the collective or transfer they wait in."""
    if rank in hung or rank not in state.waiting:
        return [
            "_first_compute_of_step (trainer/faults/rank.py:88)",
            "compute (trainer/faults/rank.py:96)",
            "forward_step (trainer/parallel/pipeline.py:88)",
            *TAIL,
        ]
    w = state.waiting[rank]
    where = (
        "p2p (trainer/parallel/pipeline.py:61)"
        if w.group == "pp"
        else f"{w.group}_collective (trainer/parallel/{w.group}.py:44)"
    )
    return [
        f"{w.op} (torch/distributed/distributed_c10d.py:4071)",
        "wrapper (torch/distributed/c10d_logger.py:81)",
        where,
        *TAIL,
    ]


def write_hang(run_dir: str, part: int, timeout_s: float, hung: set[int], state: WriteState) -> int:
    """What each stuck rank's watchdog writes ``timeout_s`` after its last progress: a ``hang``
    heartbeat and a py-spy-like stack (the hung ranks sit in the fault's sleep inside a compute
    span, the others in the collective they wait in). Returns the latest of those times."""
    latest = 0
    for rank in sorted(state.last_ns):
        ts = state.last_ns[rank] + int(timeout_s * 1e9)
        latest = max(latest, ts)
        beat = {
            "rank": [rank],
            "ts_ns": [ts],
            "step": [state.last_step.get(rank, 0)],
            "state": ["hang"],
        }
        write_part(run_dir, "heartbeats", rank, beat, part=part)
        stack = {
            "rank": [rank],
            "ts_ns": [ts],
            "reason": ["hang"],
            "thread": [HANG_THREAD],
            "stack": ["\n".join(stack_frames(rank, hung, state))],
        }
        write_part(run_dir, "stacks", rank, stack, part=0)
        state.wrote("heartbeats", 1)
        state.wrote("stacks", 1)
    return latest
