"""The plan of a run: every candidate layout predicted, ranked, and what the model can tell.

``plan_run(RUN)`` opens the run, fits its cost model (:mod:`analyzer.plan.fit`), lists the
candidate layouts of its world (:mod:`analyzer.plan.layouts`), replays a step of each and
prices its memory (:mod:`analyzer.plan.memory`). Layouts are ranked by predicted step time,
those that fit the device's memory first; those that do not are listed after, with what they
would need. The run's own layout is predicted too: its prediction against its measured step
is the model's self-check, reported beside the table.
"""

from __future__ import annotations

from typing import Any

from analyzer.db import RunError, open_run
from analyzer.plan.fit import Costs, fit_costs
from analyzer.plan.layouts import Layout, candidates, predict
from analyzer.plan.memory import GIB, parse_bytes, rank_memory, run_device_memory
from analyzer.plan.shape import PlanError, Shape, shape_of
from analyzer.synth.config import ModelShape

CAN = [
    "the step time of another dp x tp x pp x cp layout of the same number of ranks, training "
    "the same global batch, with or without full recompute and a sharded optimizer",
    "memory per rank for parameters, gradients and optimizer states as the trainer keeps "
    "them; activations as an estimate",
]
CANNOT = [
    "another number of ranks: collectives are fitted on this run's group sizes and the "
    "compute on its ranks' sharing of the host",
    "another device or another interconnect: every rate is this run's",
    "another model, sequence length or micro-batch size",
    "a tensor-parallel degree's own efficiency: compute is priced at the FLOP rate this run "
    "reached at its own tp",
    "an unsharded optimizer's all-reduce apart from the sharded one's reduce-scatter and "
    "all-gather (the same bus bytes: only its memory and its update differ here)",
    "overlap the step graph does not draw (the trainer's reduce-scatter during the last "
    "backward is priced after it), interleaved schedules, experts",
]


def _peak(meta: dict[str, Any], shape: Shape) -> float | None:
    """Peak FLOP/s of one device: the simulator's, or what the run's own MFU implies."""
    if shape.simulated:
        return ModelShape().peak_flops
    s = meta.get("summary") or {}
    fpt = (meta.get("model") or {}).get("flops_per_token")
    if s.get("mfu") and s.get("tokens_per_s") and fpt:
        return float(fpt) * float(s["tokens_per_s"]) / (float(s["mfu"]) * shape.world)
    return None


def _own(shape: Shape, costs: Costs) -> Layout:
    m = costs.layout
    rc = "full" if shape.recompute == "full" else "none"
    return Layout(m["dp"], m["tp"], m["pp"], m["cp"], shape.microbatches, rc, True)


def _row(shape: Shape, lay: Layout, costs: Costs, fpt: float | None, peak: float | None,
         capacity: float | None) -> dict[str, Any]:  # fmt: skip
    t = predict(shape, lay, costs)
    mem = rank_memory(shape, lay.dp, lay.tp, lay.pp, lay.cp, lay.recompute, lay.sharded)
    tokens = shape.global_microbatches * shape.tokens_per_microbatch
    mfu = fpt * tokens / (t.step_s * shape.world * peak) if fpt and peak and t.step_s > 0 else None
    return {
        "dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp,
        "microbatches": lay.microbatches,
        "recompute": lay.recompute,
        "sharded_optimizer": lay.sharded,
        "predicted_step_ms": round(t.step_s * 1e3, 4),
        "compute_ms": round(t.compute_s * 1e3, 4),
        "exposed_comm_ms": round(t.exposed_comm_s * 1e3, 4),
        "bubble_ms": round(t.bubble_s * 1e3, 4),
        "dominant": t.dominant,
        "mfu": None if mfu is None else round(mfu, 4),
        "memory_per_rank_bytes": int(mem["total_bytes"]),
        "memory": {k: int(v) for k, v in mem.items()},
        "fits": None if capacity is None else bool(mem["total_bytes"] <= capacity),
        "run_layout": lay == _own(shape, costs),
    }  # fmt: skip


def plan_run(path: str, *, device_memory: str | None = None, recompute: bool = True,
             sharding: bool = True) -> dict[str, Any]:  # fmt: skip
    """The plan of the run at ``path`` (see the module docstring); :class:`PlanError` or
    :class:`~analyzer.db.RunError` (one line) on a run it cannot plan."""
    capacity_given = parse_bytes(device_memory) if device_memory else None
    run = open_run(path)
    try:
        shape = shape_of(run.meta)
        if shape.world < 1:
            raise PlanError(f"{path}: run.json has no world_size")
        costs = fit_costs(run, shape)
    finally:
        run.con.close()
    meta = run.meta
    capacity: float | None
    if capacity_given is not None:
        capacity, source = capacity_given, f"--device-memory {device_memory}"
    else:
        capacity, source = run_device_memory(meta)
    fpt = (meta.get("model") or {}).get("flops_per_token")
    peak = _peak(meta, shape)
    lays, refused = candidates(shape, recompute=("none", "full") if recompute else ("none",),
                               sharded=(True, False) if sharding else (True,))  # fmt: skip
    own = _own(shape, costs)
    if own not in lays:
        lays.append(own)
    rows = [_row(shape, lay, costs, fpt, peak, capacity) for lay in lays]
    rows.sort(key=lambda r: (r["fits"] is False, r["predicted_step_ms"]))
    for i, r in enumerate(rows, 1):
        r["rank"] = i
    mine = next(r for r in rows if r["run_layout"])
    measured = None if costs.measured_step_s is None else costs.measured_step_s * 1e3
    err = None if not measured else mine["predicted_step_ms"] / measured - 1.0
    notes = list(costs.notes)
    if meta.get("device") == "cpu":
        notes.append(
            "a CPU run: its ranks share the host's cores, so a rank computes faster while "
            "others wait (a pipeline's bubble, a long collective); the FLOP rate is this "
            "run's, at its own occupancy of the cores"
        )
    if capacity is None:
        notes.append(f"device memory {source}: no layout is checked against it")
    return {
        "run": {
            "path": path,
            "world_size": shape.world,
            "mesh": costs.layout,
            "microbatches": shape.microbatches,
            "global_microbatches": shape.global_microbatches,
            "micro_batch": shape.micro_batch,
            "recompute": shape.recompute,
            "device": meta.get("device"),
            "simulated": shape.simulated,
            "device_memory_bytes": None if capacity is None else int(capacity),
            "device_memory_source": source,
            "measured_step_ms": None if measured is None else round(measured, 4),
        },  # fmt: skip
        "self_check": {
            "predicted_step_ms": mine["predicted_step_ms"],
            "measured_step_ms": None if measured is None else round(measured, 4),
            "error": None if err is None else round(err, 4),
        },  # fmt: skip
        "costs": costs.as_dict(),
        "layouts": rows,
        "refused": refused,
        "can_predict": CAN,
        "cannot_predict": CANNOT,
        "notes": notes,
    }


def _gib(b: float | None) -> str:
    return "?" if b is None else f"{b / GIB:.2f}" if b < 10 * GIB else f"{b / GIB:.0f}"


def render(r: dict[str, Any]) -> str:
    """The plan as text: the ranked table, the self-check, what it cannot predict."""
    run = r["run"]
    mesh = " x ".join(f"{k}{v}" for k, v in run["mesh"].items() if v > 1) or "1 rank"
    meas = run["measured_step_ms"]
    lines = [
        f"megascope plan: {run['world_size']} ranks, measured layout {mesh}, "
        f"{run['global_microbatches']} microbatches of {run['micro_batch']} per step, "
        f"measured step {'?' if meas is None else f'{meas:.1f} ms'}",
        f"device memory per rank: {_gib(run['device_memory_bytes'])} GiB "
        f"({run['device_memory_source']})",
        "",
        f"{'#':>3}  {'dp':>3} {'tp':>3} {'pp':>3} {'cp':>3} {'mb':>4}  {'recompute':<9} "
        f"{'zero1':<5} {'step ms':>9} {'mfu':>6} {'mem GiB':>8}  {'fits':<4}  dominated by",
    ]
    for x in r["layouts"]:
        mfu = "" if x["mfu"] is None else f"{x['mfu']:.3f}"
        fits = {True: "yes", False: "NO", None: "?"}[x["fits"]]
        mark = "  <- the run's layout" if x["run_layout"] else ""
        lines.append(
            f"{x['rank']:>3}  {x['dp']:>3} {x['tp']:>3} {x['pp']:>3} {x['cp']:>3} "
            f"{x['microbatches']:>4}  {x['recompute']:<9} {'yes' if x['sharded_optimizer'] else 'no':<5} "
            f"{x['predicted_step_ms']:>9.2f} {mfu:>6} {_gib(x['memory_per_rank_bytes']):>8}  "
            f"{fits:<4}  {x['dominant']}{mark}"
        )
    for x in r["refused"]:
        lines.append(f"  -  dp{x['dp']} tp{x['tp']} pp{x['pp']} cp{x['cp']}: {x['reason']}")
    sc = r["self_check"]
    if sc["error"] is not None:
        lines.append(
            f"\nself-check: the run's own layout predicted {sc['predicted_step_ms']:.1f} ms, "
            f"measured {sc['measured_step_ms']:.1f} ms ({100 * sc['error']:+.1f}%)"
        )
    lines.append("predicts: " + "; ".join(r["can_predict"]))
    lines.append("cannot predict: " + "; ".join(r["cannot_predict"]))
    lines += [f"note: {n}" for n in r["notes"]]
    return "\n".join(lines)


__all__ = ["PlanError", "RunError", "plan_run", "render"]
