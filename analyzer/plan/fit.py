"""The cost model fitted on a traced run: compute per FLOP, collectives per byte, the optimizer.

Everything is a median over the run's steps after its first (start-up work), read through two
queries (``analyzer/sql/plan/``):

* **compute**: each rank's forward and backward spans net of the collectives inside them (the
  tensor-parallel all-reduces a forward waits in), divided by the FLOPs that rank's shard of
  its stage does for one microbatch (:meth:`Shape.forward_flops`, split over ``tp`` and
  ``cp``). One rate for the forward, one for the backward (its recompute apart, where the
  run recomputed), pooled over ranks: ``sum(seconds) / sum(FLOPs)``. A layout with another
  ``tp`` is assumed to reach the same rate on its smaller matrices: the rate measured at the
  run's ``tp`` is its efficiency, stated in the output.
* **collectives**: per group kind (``dp``, ``tp``, ``pp`` transfers, ``cp``), ``time = hops x
  latency + bus bytes / bandwidth`` (a ring's sequential steps, :func:`hops`, and the
  nccl-tests bus factors, so that a fit on one group size prices another), least squares over
  the time a member of the run's own collectives of that kind spends in them (weighted by
  their count); a kind the run has no two shapes of takes the bandwidth of all kinds pooled,
  a kind it never ran takes the pooled fit.
* **optimizer**: the optimizer span net of its collectives, per parameter the rank updates
  (its shard: the stage's tensor-parallel shard over ``dp``).
* **data**: the data span as measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from analyzer.db import Run
from analyzer.plan.shape import PlanError, Shape

BUS = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}


def bus_bytes(op: str, size: int, nbytes: float) -> float:
    """``nbytes`` times the nccl-tests bus factor of ``op`` over ``size`` ranks (else 1)."""
    f = BUS.get(op)
    return nbytes * (f(size) if f and size > 1 else 1.0)


def hops(op: str, size: int) -> int:
    """Sequential steps of a ring over ``size`` ranks: an all-reduce ``2 (n - 1)``, a gather,
    scatter or all-to-all ``n - 1``, a pipeline transfer one."""
    if op in ("send_recv", "send", "recv"):
        return 1
    n = max(1, size - 1)
    return 2 * n if op == "all_reduce" else n


@dataclass(frozen=True)
class Line:
    """``seconds = hops * per_hop + bus_bytes * per_byte``, fitted on ``n`` collectives."""

    per_hop: float
    per_byte: float
    n: int = 0
    source: str = "fitted"  # fitted | pooled bandwidth | pooled

    def seconds(self, op: str, size: int, nbytes: float) -> float:
        """Predicted seconds of one ``op`` over ``size`` ranks moving ``nbytes``."""
        return hops(op, size) * self.per_hop + bus_bytes(op, size, nbytes) * self.per_byte

    def as_dict(self) -> dict:
        """The line for the report: latency per hop (us), bus bandwidth (GB/s; None without a
        per-byte cost), collectives fitted on and source."""
        gbps = None if self.per_byte <= 0 else 1.0 / self.per_byte / 1e9
        return {"latency_per_hop_us": round(self.per_hop * 1e6, 3), "busbw_gbps": gbps,
                "collectives": self.n, "source": self.source}  # fmt: skip


@dataclass(frozen=True)
class Costs:
    """What one operation of any layout costs, per the run (see the module docstring)."""

    forward_s_per_flop: float
    backward_s_per_flop: float  # per FLOP of the forward it differentiates
    recompute_s_per_flop: float
    optimizer_s_per_param: float
    data_s: float
    lines: dict[str, Line]  # group kind -> line; "pp" is the pipeline's send/recv
    pooled: Line
    measured_step_s: float | None
    layout: dict[str, int]
    notes: list[str] = field(default_factory=list)

    def line(self, kind: str) -> Line:
        """The line of group kind ``kind``, else the pooled one."""
        return self.lines.get(kind, self.pooled)

    def as_dict(self) -> dict:
        """The costs for the report, as rates: GFLOP/s forward and backward, ns per parameter, data
        ms and the collectives' lines."""
        return {
            "forward_gflops_per_s": _rate(self.forward_s_per_flop),
            "backward_gflops_per_s": _rate(self.backward_s_per_flop, 2.0),
            "optimizer_ns_per_param": self.optimizer_s_per_param * 1e9,
            "data_ms": self.data_s * 1e3,
            "collectives": {k: v.as_dict() for k, v in sorted(self.lines.items())},
            "collectives_pooled": self.pooled.as_dict(),
        }


def _rate(s_per_flop: float, flops: float = 1.0) -> float | None:
    return None if s_per_flop <= 0 else flops / s_per_flop / 1e9


def first_step(run: Run) -> int:
    """The first step the fit reads: the run's second (its first does start-up work)."""
    df = run.query("plan/steps")
    if df.empty or pd.isna(df.first_step[0]):
        raise PlanError(f"{run.path}: no finished step span: nothing to fit a cost model on")
    lo, hi = int(df.first_step[0]), int(df.last_step[0])
    return lo + 1 if hi > lo else lo


def fit_costs(run: Run, shape: Shape) -> Costs:
    """Fit :class:`Costs` on ``run`` (see the module docstring)."""
    mesh = {k: int((run.meta.get("mesh") or {}).get(k) or 1) for k in ("dp", "pp", "tp", "cp")}
    first = first_step(run)
    spans = run.query("plan/spans", first=first)
    notes: list[str] = []
    per = spans.pivot_table(index=["rank", "stage"], columns="name", values="net_s").fillna(0.0)
    for need in ("forward", "backward"):
        if need not in per.columns:
            raise PlanError(
                f"{run.path}: no {need} spans: the planner needs the compute per microbatch"
            )
    for col in ("recompute", "optimizer", "data"):
        if col not in per.columns:
            per[col] = 0.0
    stages = per.index.get_level_values("stage").to_numpy()
    flops = np.array(
        [shape.forward_flops(mesh["pp"], mesh["tp"], mesh["cp"], int(s)) for s in stages]
    )
    fwd = float(per["forward"].sum() / flops.sum())
    rec_s = per["recompute"].to_numpy()
    bwd = float((per["backward"].to_numpy() - rec_s).clip(min=0).sum() / flops.sum())
    rec = float(rec_s.sum() / flops.sum()) if rec_s.sum() > 0 else fwd
    updated = np.array(
        [shape.rank_params(mesh["pp"], mesh["tp"], int(s)) / mesh["dp"] for s in stages]
    )
    opt = float(per["optimizer"].sum() / updated.sum())
    lines, pooled = _fit_lines(run.query("plan/collectives", first=first), notes)
    steps = spans[spans.name == "step"]
    summary = run.meta.get("summary") or {}
    measured = summary.get("median_step_ms")
    if measured:
        measured_s = float(measured) / 1e3
    elif len(steps):
        measured_s = float(steps.span_s.max())
    else:
        measured_s = None
    return Costs(fwd, bwd, rec, opt, float(per["data"].median()), lines, pooled, measured_s,
                 mesh, notes)  # fmt: skip


def _fit(h: np.ndarray, bus: np.ndarray, t: np.ndarray, n: np.ndarray,
         per_byte: float | None) -> tuple[float, float]:  # fmt: skip
    """Seconds per hop and per bus byte: weighted least squares through the origin, or with
    a given ``per_byte`` the weighted mean of what is left per hop; both at least zero."""
    w = np.sqrt(n)
    if per_byte is None:
        a = np.vstack([h, bus]).T * w[:, None]
        (hop, per), *_ = np.linalg.lstsq(a, t * w, rcond=None)
        if per < 0:
            return float(np.average(t / h, weights=n)), 0.0
        if hop < 0:
            return 0.0, float(np.sum(n * t * bus) / np.sum(n * bus * bus))
        return float(hop), float(per)
    return max(0.0, float(np.average((t - bus * per_byte) / h, weights=n))), per_byte


def _fit_lines(df: pd.DataFrame, notes: list[str]) -> tuple[dict[str, Line], Line]:
    """Each group kind's line, and the pooled line that prices a collective of a kind the run
    never ran: the kinds' own fits averaged by their counts (collectives before pipeline
    transfers, which a ring's steps do not describe), else one fit over everything."""
    if df.empty:
        notes.append("the run has no timed collectives: communication is priced at zero")
        return {}, Line(0.0, 0.0, 0, "none")
    rows = list(zip(df.op, df["size"], df.nbytes, strict=True))
    bus = np.array([bus_bytes(o, int(s), float(b)) for o, s, b in rows])
    h = np.array([hops(o, int(s)) for o, s, _ in rows], dtype=float)
    t, n = df.transfer_s.to_numpy(float), df.n.to_numpy(float)
    lines: dict[str, Line] = {}
    single = []
    for kind in df.kind.unique():
        sel = (df.kind == kind).to_numpy()
        if len(np.unique(bus[sel] / h[sel])) >= 2:
            hop, per = _fit(h[sel], bus[sel], t[sel], n[sel], None)
            lines[str(kind)] = Line(hop, per, int(n[sel].sum()))
        else:
            single.append((str(kind), sel))
    fitted = [x for k, x in lines.items() if k != "pp"] or list(lines.values())
    if fitted:
        w = np.array([x.n for x in fitted], dtype=float)
        pooled = Line(float(np.average([x.per_hop for x in fitted], weights=w)),
                      float(np.average([x.per_byte for x in fitted], weights=w)),
                      int(w.sum()), "pooled")  # fmt: skip
    else:
        varied = len(np.unique(bus / h)) >= 2
        hop, per = _fit(h, bus, t, n, None if varied else 0.0)
        pooled = Line(hop, per, int(n.sum()), "pooled")
    for kind, sel in single:
        hop, per = _fit(h[sel], bus[sel], t[sel], n[sel], pooled.per_byte)
        lines[kind] = Line(hop, per, int(n[sel].sum()), "pooled bandwidth")
    if not fitted and lines:
        fitted_kinds = [k for k in lines if k != "pp"] or list(lines)
        w = np.array([lines[k].n for k in fitted_kinds], dtype=float)
        pooled = Line(float(np.average([lines[k].per_hop for k in fitted_kinds], weights=w)),
                      pooled.per_byte, int(w.sum()), "pooled")  # fmt: skip
    return lines, pooled
