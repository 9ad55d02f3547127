"""``synthesize(cfg, out)``: simulate a cluster and write its SPEC run directory.

The step's graph is built once from the schedule (:mod:`analyzer.synth.stepgraph`); each step,
its durations are generated (:mod:`analyzer.synth.durations`) and replayed by the what-if's
engine (:class:`analyzer.whatif.replay.Replayer`, in float64), every rank starting where its
previous step ended; the rows are read off the replay's starts and ends. Steps are replayed one
after the other (each needs where every rank ended the last one), each replay one vectorized
pass per level over all ranks' slots.

The order is that of a real run: run.json (status ``running``) and the topology first, then the
steps, written chunk by chunk, then run.json again with the final status and summary. A hang
stops the simulation at the step where every rank is stuck; the run is then ``hung`` (stacks
taken ``hang_timeout_s`` after the last event) or, after a crash, ``failed``.
"""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from analyzer.digests import write_digests
from analyzer.synth import ranges
from analyzer.synth.cluster import build_cluster
from analyzer.synth.config import SynthConfig, validate
from analyzer.synth.durations import Durations
from analyzer.synth.record import StageRows
from analyzer.synth.stepgraph import StepGraph
from analyzer.synth.work import TOP_K
from analyzer.synth.writer import ChunkJob, WriteState, write_hang, write_stage, write_topology
from analyzer.whatif.replay import Replayer
from tracer.rundir import base_run_json, mesh_groups, write_json_atomic

log = logging.getLogger(__name__)

BASE_NS = 1_767_225_600 * 10**9  # 2026-01-01T00:00:00Z: a fixed start keeps runs reproducible
CHUNK_ELEMENTS = 160_000_000  # event x rank time entries buffered before a chunk is written (~4 GB)
CRASH_TEARDOWN_S = 5.0
LAYOUTS = ("rank", "ranks")  # a folder per rank (as the tracer writes), or per stage (compacted)


def _iso(ns: int) -> str:
    import datetime as dt

    t = dt.datetime.fromtimestamp(ns / 1e9, tz=dt.timezone.utc)
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _run_json(cfg: SynthConfig, injections: Sequence[str]) -> dict[str, Any]:
    m = cfg.model
    pp = cfg.mesh["pp"]
    meta = base_run_json(
        run_id=f"synth-{cfg.world_size}r-{cfg.steps}s-seed{cfg.seed}",
        world_size=cfg.world_size,
        mesh=cfg.mesh,
        groups=mesh_groups(cfg.mesh),
        device="cuda",
        model={
            "config": {
                "layers": m.layers_per_stage * pp,
                "hidden": m.hidden,
                "seq_len": m.seq_len,
                "vocab": m.vocab,
                "micro_batch": m.micro_batch,
                "microbatches": cfg.microbatches,
                **({"vpp": cfg.vpp} if cfg.vpp > 1 else {}),
                **({"experts": cfg.experts, "top_k": TOP_K, "ep": cfg.ep} if cfg.experts else {}),
            },
            "params": int(m.params(pp)),
            "flops_per_token": m.flops_per_token(pp),
        },
        tracer={
            "simulated": True,
            "seed": cfg.seed,
            "noise": cfg.noise,
            "detail": cfg.detail,
            "sp": cfg.sp,
            "hang_timeout_s": cfg.hang_timeout_s,
            "extras": {
                "imbalance": list(cfg.extras.imbalance),
                "throttle": list(cfg.extras.throttle),
                "regression": cfg.extras.regression,
                **(
                    {"hw_classes": [[c.name, c.first, c.last, c.speed] for c in cfg.hw_classes]}
                    if cfg.hw_classes
                    else {}
                ),
                **(
                    {"work_imbalance": cfg.extras.work_imbalance}
                    if cfg.extras.work_imbalance
                    else {}
                ),
            },
        },
        injections=list(injections),
        versions={
            "simulator": "megascope synth 1",
            "torch": None,
            "cuda": "12.4 (simulated)",
            "nccl": "2.21 (simulated)",
        },
    )
    meta["started_at"] = _iso(BASE_NS)
    meta["host"] = "synth"
    return meta


def _summary(cfg: SynthConfig, medians: list[float]) -> dict[str, Any]:
    m = cfg.model
    median = statistics.median(medians) if medians else None
    tokens = cfg.mesh["dp"] * cfg.microbatches * m.micro_batch * m.seq_len
    tps = tokens / (median / 1e3) if median else None
    mfu = tps * m.flops_per_token(cfg.mesh["pp"]) / (cfg.world_size * m.peak_flops) if tps else None
    n = len(medians)
    return {
        "steps": n,
        "median_step_ms": median,
        "tokens_per_s": tps,
        "mfu": mfu,
        "loss_first": 10.9,
        "loss_last": round(2.6 + 8.3 * float(np.exp(-max(n - 1, 0) / 40)), 4),
    }


def _chunk_steps(entries_per_step: int) -> int:
    """Steps buffered before a chunk is written: one more would take the buffered time
    entries past ``CHUNK_ELEMENTS``."""
    n = 1
    while entries_per_step * (n + 1) <= CHUNK_ELEMENTS:
        n += 1
    return n


class _Simulation:
    """The step graph, its durations and its replay, built once; :meth:`step` plays a step."""

    def __init__(self, cfg: SynthConfig) -> None:
        rng = np.random.default_rng(cfg.seed)
        cl = build_cluster(cfg, rng)
        sg = StepGraph(cfg, cl)
        self.durations = Durations(cfg, cl, sg, rng)
        self.replayer = Replayer(sg.graph(), dtype=np.float64)
        pair = np.array([b.pair if b.pair >= 0 else i for i, b in enumerate(sg.blocks)])
        self.stages = [StageRows(rows, pair) for rows in sg.rows]
        self.last = np.array(sg.last)  # each stage's last block: where its ranks end the step
        self.blocks, self.size = len(sg.blocks), cl.stage_size
        self.chunk = _chunk_steps(sum(len(r.spans) + len(r.colls) for r in sg.rows) * self.size)

    def step(self, step: int, origin: np.ndarray) -> np.ndarray:
        """Play ``step`` with each rank beginning at ``origin[rank]``, add its rows to the
        stages' buffers; returns when each rank ended it (``inf``: never)."""
        d = self.durations.step(step)
        _, start, end = self.replayer.run(d.reshape(-1, 1), keep=True, origin=origin[:, None])
        start, end = start.reshape(self.blocks, -1), end.reshape(self.blocks, -1)
        for st in self.stages:
            st.add(step, start, end)
        return end[self.last].reshape(-1)


def synthesize(
    cfg: SynthConfig,
    out: str,
    injections: Sequence[str] = (),
    progress: Callable[[str], None] | None = None,
    jobs: int = 2,
    layout: str = "rank",
    rows: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Simulate ``cfg`` and write the run directory ``out`` (created; must not hold a run).

    Returns the final run.json. Deterministic: the same config and seed give the same rows.
    ``jobs`` threads write the Parquet parts (Arrow compresses and writes without the GIL).
    ``layout``: ``rank``, a folder per rank and a part per chunk of steps, as the tracer
    writes; ``ranks``, the compacted layout of docs/spec.md §2 (a file per pipeline stage and
    table, :mod:`analyzer.synth.ranges`), the same rows in a few files, written several times
    faster. ``rows``, when given, receives the number of rows written per table.
    """
    validate(cfg)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    sim = _Simulation(cfg)
    os.makedirs(out, exist_ok=True)
    meta = _run_json(cfg, injections or [f.spec for f in cfg.faults])
    write_json_atomic(os.path.join(out, "run.json"), meta)
    sink = ranges.RangeWriter(out, sim.size) if layout == "ranks" else None
    try:
        return _simulate(cfg, out, meta, sim, sink, progress, jobs, rows)
    except BaseException:
        if sink is not None:
            sink.abort()
        raise


def _simulate(
    cfg: SynthConfig,
    out: str,
    meta: dict[str, Any],
    sim: _Simulation,
    sink: ranges.RangeWriter | None,
    progress: Callable[[str], None] | None,
    jobs: int,
    rows: dict[str, int] | None,
) -> dict[str, Any]:
    state = WriteState(rows=rows if rows is not None else {})
    if sink is None:
        write_topology(out, cfg.mesh, cfg.world_size, state, cfg.hosts, cfg.hw_classes)
    else:
        ranges.write_topology(sink, cfg.mesh, cfg.world_size, state, cfg.hosts, cfg.hw_classes)
    crash = {
        f.rank: f.step // cfg.flush_steps * cfg.flush_steps for f in cfg.faults if f.kind == "crash"
    }
    throttle: dict[int, list[tuple[float, int]]] = {}
    for rank, factor, from_step in cfg.extras.throttle:
        throttle.setdefault(rank, []).append((factor, from_step))
    medians, part, first = [], 0, 0
    stuck = False
    origin = np.zeros(cfg.world_size)  # where each rank begins the step
    for step in range(cfg.steps):
        if step == first:
            for st in sim.stages:
                st.begin(min(sim.chunk, cfg.steps - step), sim.size)
            sim.durations.given.begin()
        finish = sim.step(step, origin)
        took = finish - origin
        took = took[np.isfinite(took)]
        stuck = not np.isfinite(finish).any()
        if took.size and not stuck:
            medians.append(float(np.median(took)) * 1e3)
        origin = finish
        if stuck or step == cfg.steps - 1 or step + 1 - first >= sim.chunk:
            work = sim.durations.given.chunk()
            job = ChunkJob(out, part, BASE_NS, crash, throttle, gpu=True, seed=cfg.seed,
                           jobs=jobs, work=work)  # fmt: skip
            if sink is None:
                for s, st in enumerate(sim.stages):
                    write_stage(job, st.tables(), s * sim.size, state)
            else:
                ranges.write_chunk(sink, job, [st.tables() for st in sim.stages], state)
            part, first = part + 1, step + 1
        if progress:
            progress(f"step {step + 1}/{cfg.steps}")
        if stuck:
            break
    return _finish(cfg, out, meta, medians, state, stuck, part, sink)


def _finish(
    cfg: SynthConfig,
    out: str,
    meta: dict[str, Any],
    medians: list[float],
    state: WriteState,
    stuck: bool,
    part: int,
    sink: ranges.RangeWriter | None,
) -> dict[str, Any]:
    """Final status, the watchdogs' records of a hang, summary; rewrite run.json.

    A crash ends the run a few seconds after the last event (the launcher sees the process
    exit and stops the others); a hang ends when the watchdogs fire, ``hang_timeout_s`` after
    each rank's last progress.
    """
    end_ns = max(state.last_ns.values(), default=BASE_NS)
    status = "finished"
    if stuck:
        crashed = any(f.kind == "crash" and f.step < cfg.steps for f in cfg.faults)
        status = "failed" if crashed else "hung"
        if crashed:
            end_ns += int(CRASH_TEARDOWN_S * 1e9)
        else:
            hung = {f.rank for f in cfg.faults if f.kind == "hang" and f.step < cfg.steps}
            if sink is None:
                end_ns = write_hang(out, part, cfg.hang_timeout_s, hung, state)
            else:
                end_ns = ranges.write_hang(sink, cfg.hang_timeout_s, hung, state)
    if sink is not None:
        sink.close()  # the files appear before run.json says the run ended
    write_digests(out)  # as the tracer writes them at each flush (docs/spec.md §2)
    meta["status"] = status
    meta["ended_at"] = _iso(end_ns)
    meta["summary"] = _summary(cfg, medians)
    write_json_atomic(os.path.join(out, "run.json"), meta)
    log.info("synth: wrote %s (%d ranks, status %s)", out, cfg.world_size, status)
    return meta
