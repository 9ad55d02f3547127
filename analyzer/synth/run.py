"""``synthesize(cfg, out)``: simulate a cluster and write its SPEC run directory.

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

from analyzer.synth.cluster import build_cluster
from analyzer.synth.config import SynthConfig, validate
from analyzer.synth.engine import StepModel
from analyzer.synth.record import StageLog, stack_stage
from analyzer.synth.writer import ChunkJob, WriteState, write_hang, write_stage, write_topology
from tracer.rundir import base_run_json, mesh_groups, write_json_atomic

log = logging.getLogger(__name__)

BASE_NS = 1_767_225_600 * 10**9  # 2026-01-01T00:00:00Z: a fixed start keeps runs reproducible
CHUNK_ELEMENTS = 160_000_000  # event x rank time entries buffered before a chunk is written (~4 GB)
CRASH_TEARDOWN_S = 5.0


def _iso(ns: int) -> str:
    import datetime as dt

    t = dt.datetime.fromtimestamp(ns / 1e9, tz=dt.timezone.utc)
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _step_factors(cfg: SynthConfig, model: StepModel, step: int) -> list[np.ndarray]:
    """Compute factors that change with the step: GPU throttling and a regression drift."""
    drift = 1.0 + (cfg.extras.regression - 1.0) * step / max(1, cfg.steps - 1)
    factors = [np.full(model.shape, drift) for _ in range(cfg.mesh["pp"])]
    size = model.cl.stage_size
    for rank, factor, from_step in cfg.extras.throttle:
        if step >= from_step:
            factors[rank // size].reshape(-1)[rank % size] *= factor
    return factors


def _work_factors(
    cfg: SynthConfig, model: StepModel, rng: np.random.Generator
) -> list[np.ndarray] | None:
    """This step's forward/backward factor of each dp rank (``extras.work_imbalance``), the
    same on every stage, cp and tp rank of that dp rank; None when off."""
    sigma = cfg.extras.work_imbalance
    if sigma <= 0:
        return None
    per_dp = rng.lognormal(0.0, sigma, size=model.shape[0])[:, None, None]
    return [np.broadcast_to(per_dp, model.shape) for _ in range(cfg.mesh["pp"])]


def _blocked(cfg: SynthConfig, model: StepModel, step: int) -> list[np.ndarray]:
    out = [np.zeros(model.shape, dtype=bool) for _ in range(cfg.mesh["pp"])]
    size = model.cl.stage_size
    for f in cfg.faults:
        if f.kind in ("hang", "crash") and f.step == step:
            out[f.rank // size].reshape(-1)[f.rank % size] = True
    return out


def _step_median_ms(logs: list[StageLog]) -> float | None:
    """Median over ranks of the step that just ended (``None`` when no rank finished it)."""
    d = np.concatenate([lg.span_end[-1] - lg.span_start[-1] for lg in logs])
    d = d[np.isfinite(d)]
    return float(np.median(d)) * 1e3 if d.size else None


def _run_json(cfg: SynthConfig, injections: Sequence[str], model: StepModel) -> dict[str, Any]:
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


def _chunk_full(model: StepModel, steps_in_chunk: int) -> bool:
    """Whether one more step would take the buffered time entries past ``CHUNK_ELEMENTS``."""
    events = sum(len(lg.coll_static) + len(lg.span_static) for lg in model.logs)
    buffered = events * model.cl.stage_size
    return buffered * (steps_in_chunk + 1) / steps_in_chunk > CHUNK_ELEMENTS


def _write_chunk(cfg: SynthConfig, model: StepModel, job: ChunkJob, state: WriteState) -> None:
    size = model.cl.stage_size
    for s in range(cfg.mesh["pp"]):
        st = stack_stage(model.logs[s])
        model.logs[s] = StageLog()  # free the lists while this stage is written
        write_stage(job, st, s * size, state)


def synthesize(
    cfg: SynthConfig,
    out: str,
    injections: Sequence[str] = (),
    progress: Callable[[str], None] | None = None,
    jobs: int = 2,
) -> dict[str, Any]:
    """Simulate ``cfg`` and write the run directory ``out`` (created; must not hold a run).

    Returns the final run.json. Deterministic: the same config and seed give the same files.
    ``jobs`` threads write the Parquet parts (Arrow compresses and writes without the GIL).
    """
    validate(cfg)
    rng = np.random.default_rng(cfg.seed)
    model = StepModel(cfg, build_cluster(cfg, rng), rng)
    os.makedirs(out, exist_ok=True)
    meta = _run_json(cfg, injections or [f.spec for f in cfg.faults], model)
    write_json_atomic(os.path.join(out, "run.json"), meta)
    write_topology(out, cfg.mesh, cfg.world_size)
    crash = {
        f.rank: f.step // cfg.flush_steps * cfg.flush_steps for f in cfg.faults if f.kind == "crash"
    }
    throttle: dict[int, list[tuple[float, int]]] = {}
    for rank, factor, from_step in cfg.extras.throttle:
        throttle.setdefault(rank, []).append((factor, from_step))
    state, medians, part, first = WriteState(), [], 0, 0
    stuck = False
    work_rng = np.random.default_rng([cfg.seed, 0x5EED])  # its own stream: the rest unchanged
    for step in range(cfg.steps):
        model.run_step(
            step,
            _step_factors(cfg, model, step),
            _blocked(cfg, model, step),
            _work_factors(cfg, model, work_rng),
        )
        median = _step_median_ms(model.logs)
        stuck = not model.finite()
        if median is not None and not stuck:
            medians.append(median)
        if stuck or step == cfg.steps - 1 or _chunk_full(model, step + 1 - first):
            job = ChunkJob(out, part, BASE_NS, crash, throttle, gpu=True, seed=cfg.seed, jobs=jobs)
            _write_chunk(cfg, model, job, state)
            part, first = part + 1, step + 1
        if progress:
            progress(f"step {step + 1}/{cfg.steps}")
        if stuck:
            break
    return _finish(cfg, out, meta, medians, state, stuck, part)


def _finish(
    cfg: SynthConfig,
    out: str,
    meta: dict[str, Any],
    medians: list[float],
    state: WriteState,
    stuck: bool,
    part: int,
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
            end_ns = write_hang(out, part, cfg.hang_timeout_s, hung, state)
    meta["status"] = status
    meta["ended_at"] = _iso(end_ns)
    meta["summary"] = _summary(cfg, medians)
    write_json_atomic(os.path.join(out, "run.json"), meta)
    log.info("synth: wrote %s (%d ranks, status %s)", out, cfg.world_size, status)
    return meta
