"""Run against run: whether B's training is slower than A's, where, and beyond the noise.

``compare(a, b)`` takes two opened runs and returns the report of ``megascope compare``
(docs/spec.md §4). Each run is read over the steps ``analyze`` would take (the complete steps
but the warm-up, :func:`analyzer.findings.step_window`) into one row per (rank, step):

* the step (views/rank_step_sums.sql, as analyze's median step);
* its phases: ``data`` (the data spans), ``forward``, ``backward``, ``optimizer`` (the spans of
  those names, less the time the rank was blocked in collectives called inside them: their own
  work) and ``exposed_comm`` (the time the rank was blocked in collectives: waiting for its
  peers and the transfer, not hidden under any work of its own), from
  analyzer/sql/compare/phase_spans.sql and blocked.sql;
* its ``own`` work: the step less its exposed communication (what a slow rank makes longer
  on itself, while its peers' step grows by waiting);
* the time blocked in each collective kind of each group (``tp all_gather``, ``pp recv``...).

Per step, the run's step time is the median over its ranks (as analyze's), a phase or a
collective kind is the mean over the ranks that recorded it. A against B is the difference of
the medians over steps with a bootstrap interval (analyzer/compare_noise.py). A rank changed
when its own work, or one of its own phases, differs beyond the noise; ranks whose exposed
communication alone changed only waited for others. The findings of each run (the same
``analyze`` as ``megascope analyze``) are set side by side: those that appeared in B and
those that disappeared, by kind and ranks. Several baseline runs as A (``compare A1 A2 -- B``)
are pooled (:func:`pool`); ``--fail-above`` is decided by analyzer/compare_gate.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

from analyzer import compare_gate
from analyzer.compare_noise import FLOOR_SHARE, LEVEL, RESAMPLES, SEED, Diff, beyond, bootstrap
from analyzer.db import Run
from analyzer.findings import analyze_context, step_window
from analyzer.findings.common import Context, Thresholds
from analyzer.findings.record import Finding, Report
from analyzer.findings.registry import CULPRIT_KINDS
from analyzer.findings.stage_imbalance import stage_table

SCHEMA = "megascope.compare/1"
PHASES = ("data", "forward", "backward", "optimizer", "exposed_comm")
OWN_PHASES = ("data", "forward", "backward", "optimizer")  # a rank's own, not waiting
NO_DIFFERENCE = "no difference beyond noise"
# a stage's growth that is evidence where both runs counted CPU time (:func:`stage_evidence`):
# in two sets of 20 rounds of a 2-stage pipeline on 2 cores, healthy twins' stage ratio in CPU
# time moved by 3.2% and 4.0% (sd; 11% at most), in wall time by 8.8% and 8.5%; a stage slowed
# 1.12x grew by 4-23% in CPU time (docs/benchmarks.md)
CPU_STAGE_GROWTH = 0.05
STAGE_COLUMNS = ["ratio", "cpu_ratio"]


class CompareError(ValueError):
    """A run that cannot be compared (no complete step with spans); the message is one line."""


@dataclass
class Side:
    """One run as compared: its findings report and its per-(rank, step) frames."""

    path: str
    report: Report
    rank_steps: pd.DataFrame  # rank, step, step_ns, <phase>_ns..., own_ns
    kinds: pd.DataFrame  # rank, step, group, op, blocked_ns
    coords: pd.DataFrame  # rank_coords, indexed by rank
    # per pipeline stage, its compute over the other stages', in wall and in CPU time
    # (stage_imbalance.stage_table's ratio and cpu_ratio)
    stages: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=STAGE_COLUMNS))
    # per step, the mean over the ranks of their training threads' CPU time (ns): a CPU device
    # that counted it (Context.rank_cpu), else empty
    cpu: np.ndarray = field(default_factory=lambda: np.empty(0))


def read_side(run: Run, *, whatif: bool = True) -> Side:
    """Analyze ``run`` (its findings) and read its steps split into phases."""
    lo, hi = step_window(run, None)  # the steps analyze takes
    spans = run.query("compare/phase_spans", lo=lo, hi=hi)
    if spans.empty:
        raise CompareError(f"{run.path}: no complete step with spans to compare")
    # a send blocks its caller where it is host-timed (as in findings/rank_steps.sql)
    host_timed = str(run.meta.get("device", "")).startswith("cpu")
    blocked = run.query("compare/blocked", lo=lo, hi=hi, sends_block=host_timed)
    ctx = Context(run=run, lo=lo, hi=hi)
    report = analyze_context(ctx, whatif=whatif)
    kinds = blocked.groupby(["rank", "step", "group", "op"], as_index=False).blocked_ns.sum()
    coords = run.sql("select * from rank_coords order by rank").set_index("rank")
    stages = pd.DataFrame(columns=STAGE_COLUMNS)
    if coords["pp"].nunique() > 1:
        stages = stage_table(ctx)[STAGE_COLUMNS].astype(float)
    cpu = ctx.rank_cpu.groupby("step").cpu_ns.mean().to_numpy(dtype=float)
    return Side(run.path, report, split_phases(spans, blocked), kinds, coords, stages, cpu)


def split_phases(spans: pd.DataFrame, blocked: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, step): each phase's span time less the blocked time inside it, the exposed
    communication (all blocked time) and the own work (step less exposed communication)."""
    df = spans.set_index(["rank", "step"]).astype(float)
    inside = blocked.dropna(subset=["phase"]).pivot_table(
        index=["rank", "step"], columns="phase", values="blocked_ns", aggfunc="sum"
    )
    for phase in OWN_PHASES:
        held = inside[phase].reindex(df.index).fillna(0) if phase in inside else 0.0
        df[f"{phase}_ns"] = (df[f"{phase}_ns"] - held).clip(lower=0)
    total = blocked.groupby(["rank", "step"]).blocked_ns.sum().reindex(df.index).fillna(0)
    df["exposed_comm_ns"] = total.astype(float)
    df["own_ns"] = (df["step_ns"] - df["exposed_comm_ns"]).clip(lower=0)
    return df.reset_index()


def _run_series(side: Side) -> pd.DataFrame:
    """Per step: the step time (median over ranks) and each phase (mean over ranks), ns."""
    rs = side.rank_steps
    if rs.empty:
        return pd.DataFrame(columns=["step", *PHASES])
    per = rs.groupby("step")
    out = per[[f"{p}_ns" for p in PHASES]].mean()
    out.columns = list(PHASES)
    out.insert(0, "step", per.step_ns.median())
    return out


def _kind_series(side: Side) -> pd.DataFrame:
    """Per step and (group, op): the mean blocked time over the ranks that recorded it."""
    k = side.kinds
    if k.empty:
        return pd.DataFrame()
    key = k["group"].astype(str) + " " + k["op"].astype(str)
    return k.assign(key=key).pivot_table(
        index="step", columns="key", values="blocked_ns", aggfunc="mean"
    )


def _rank_series(side: Side, metrics: tuple[str, ...]) -> pd.DataFrame:
    """Per step, a column per (rank, metric): that rank's value in ns."""
    rs = side.rank_steps
    if rs.empty:
        return pd.DataFrame()
    wide = rs.pivot_table(index="step", columns="rank", values=[f"{m}_ns" for m in metrics])
    wide.columns = [f"{int(r)}:{m[:-3]}" for m, r in wide.columns]
    return wide


def _diffs(a: pd.DataFrame, b: pd.DataFrame, alone: tuple[str, ...] = ()) -> dict[str, Diff]:
    """Each column of ``a`` and ``b`` (per step, ns; either may lack it) compared, their
    intervals holding together (compare_noise's families), but those named ``alone``."""
    cols = list(dict.fromkeys([*a.columns, *b.columns]))
    mat_a = a.reindex(columns=cols).to_numpy(dtype=float)
    mat_b = b.reindex(columns=cols).to_numpy(dtype=float)
    family = len([c for c in cols if c not in alone])
    families = [1 if c in alone else family for c in cols]
    return dict(zip(cols, bootstrap(mat_a, mat_b, families=families), strict=True))


def _ms(x: float) -> float | None:
    return round(x / 1e6, 3) if np.isfinite(x) else None


def row(d: Diff, floor_ns: float) -> dict[str, Any]:
    """One quantity of the report: A's and B's medians, B - A with its interval (ms), the
    change in percent of A's, and the verdict (slower, faster, within noise, only in A/B)."""
    if not np.isfinite(d.a) or not np.isfinite(d.b):
        verdict = "only in B" if np.isfinite(d.b) else "only in A" if np.isfinite(d.a) else ""
    elif beyond(d, floor_ns):
        verdict = "slower" if d.diff > 0 else "faster"
    else:
        verdict = "within noise"
    pct = 100 * d.diff / d.a if np.isfinite(d.diff) and d.a else None
    return {
        "a_ms": _ms(d.a),
        "b_ms": _ms(d.b),
        "diff_ms": _ms(d.diff),
        "low_ms": _ms(d.low),
        "high_ms": _ms(d.high),
        "change_pct": round(pct, 2) if pct is not None else None,
        "verdict": verdict,
    }


def changed(r: dict[str, Any]) -> bool:
    """Whether a row of the report is a difference beyond the noise (or in one run only)."""
    return r["verdict"] in ("slower", "faster", "only in A", "only in B")


def moved(r: dict[str, Any]) -> bool:
    """Whether a row measured in both runs differs beyond the noise."""
    return r["verdict"] in ("slower", "faster")


def _ranks(a: Side, b: Side, floor_ns: float) -> list[dict[str, Any]]:
    """Per rank of both runs: its step, own work and phases, A against B."""
    metrics = ("step", "own", *PHASES)
    diffs = _diffs(_rank_series(a, metrics), _rank_series(b, metrics))
    ranks = sorted({int(k.split(":")[0]) for k in diffs})
    out = []
    for rank in ranks:
        rows = {m: row(diffs[f"{rank}:{m}"], floor_ns) for m in metrics if f"{rank}:{m}" in diffs}
        own = any(moved(rows[m]) for m in ("own", *OWN_PHASES) if m in rows)
        waited = not own and "exposed_comm" in rows and moved(rows["exposed_comm"])
        coords = _coords(b, rank) or _coords(a, rank)
        out.append({"rank": rank, "coords": coords, "changed": own, "waited": waited, **rows})
    return out


def _coords(side: Side, rank: int) -> dict[str, Any]:
    if rank not in side.coords.index:
        return {}
    c = side.coords.loc[rank]
    out: dict[str, Any] = {k: int(c[k]) for k in ("dp", "pp", "tp", "cp") if pd.notna(c[k])}
    if "host" in c and isinstance(c["host"], str):
        out["host"] = c["host"]
    return out


def _finding_keys(report: Report) -> dict[tuple[str, tuple[int, ...]], Finding]:
    return {(f["kind"], tuple(f["ranks"])): f for f in report["findings"]}


def _brief(f: Finding) -> dict[str, Any]:
    return {k: f[k] for k in ("kind", "ranks", "severity", "message")}


def side_by_side(a: Report, b: Report) -> dict[str, list[dict[str, Any]]]:
    """The findings of both reports by (kind, ranks): appeared in B, disappeared from A, in
    both (with B's severity and message, and A's severity)."""
    ka, kb = _finding_keys(a), _finding_keys(b)
    return {
        "a": [_brief(f) for f in a["findings"]],
        "b": [_brief(f) for f in b["findings"]],
        "appeared": [_brief(f) for k, f in kb.items() if k not in ka],
        "disappeared": [_brief(f) for k, f in ka.items() if k not in kb],
        "kept": [{**_brief(f), "a_severity": ka[k]["severity"]} for k, f in kb.items() if k in ka],
    }


def pool(sides: Sequence[Side]) -> Side:
    """Baseline runs as one reference: their steps one after the other (each run's step numbers
    moved past the previous run's last), the findings that half of them or more make (a kind
    naming the same ranks: the configuration's, not one run's; at the median of their
    severities), the first run's layout.

    One healthy run in a dozen may name a rank of a 2-rank run a straggler on shared cores (3
    of 40 in docs/benchmarks.md): with every baseline's findings in A, one such run among the
    baselines made the same rank, slowed in B, no evidence; a finding of one run of ten is
    that run's."""
    if len(sides) == 1:
        return sides[0]
    rank_steps, kinds = [], []
    offset = int(sides[0].rank_steps.step.min()) if not sides[0].rank_steps.empty else 0
    for side in sides:
        first = int(side.rank_steps.step.min()) if not side.rank_steps.empty else 0
        shift = offset - first
        rank_steps.append(side.rank_steps.assign(step=side.rank_steps.step + shift))
        kinds.append(side.kinds.assign(step=side.kinds.step + shift))
        if not side.rank_steps.empty:
            offset = int(side.rank_steps.step.max()) + shift + 1
    rs = pd.concat(rank_steps, ignore_index=True)
    seen: dict[tuple[str, tuple[int, ...]], Finding] = {}
    made: dict[tuple[str, tuple[int, ...]], list[float]] = {}
    for side in sides:
        for key, f in _finding_keys(side.report).items():
            seen.setdefault(key, f)
            made.setdefault(key, []).append(float(f["severity"]))
    seen = {key: {**f, "severity": float(np.median(made[key]))}
            for key, f in seen.items() if 2 * len(made[key]) >= len(sides)}  # fmt: skip
    run = sides[0].report["run"].copy()
    run["steps"] = [int(rs.step.min()), int(rs.step.max())]  # the pooled steps' numbers
    run["median_step_ms"] = _ms(float(rs.groupby("step").step_ns.median().median()))
    report = sides[0].report.copy()
    report["run"], report["findings"] = run, list(seen.values())
    path = " + ".join(s.path for s in sides)
    stages = pd.concat([s.stages for s in sides]).groupby(level=0).median()
    cpu = np.concatenate([s.cpu for s in sides])
    return replace(sides[0], path=path, report=report, rank_steps=rs,
                   kinds=pd.concat(kinds, ignore_index=True), stages=stages, cpu=cpu)  # fmt: skip


def evidence(report: dict[str, Any], pct: float | None = None) -> list[int]:
    """Ranks that a culprit's finding of B names (:func:`culprits`: one that appeared in B, or
    one of A too whose price grew by more than ``pct``), whose own work is longer in B than in
    A: B changed there, whatever the run-to-run drift (analyzer/compare_gate.py). The finding,
    not the rank's median, is the evidence: a rank slow in fewer than half of B's steps leaves
    its median where it was. A culprit's kind only (:data:`CULPRIT_KINDS`): a stage that
    computes longer than the others (the last stage's head and loss) is read in one healthy
    run and not the next where it sits near its detector's bar, and says nothing of B having
    changed unless its ratio to the other stages grew (:func:`stage_evidence`)."""
    named = {r for f in culprits(report, pct) for r in f["ranks"]}
    longer = {r["rank"] for r in report["ranks"] if ((r.get("own") or {}).get("diff_ms") or 0) > 0}
    return sorted(named & longer)


def culprits(report: dict[str, Any], pct: float | None = None) -> list[dict[str, Any]]:
    """The culprits' findings of B that say B changed, each with the severity it is priced
    at: those that appeared in B, at theirs; and those A made too (the same kind naming the
    same ranks: a healthy run on shared cores names a straggler now and then, and B's rank
    slowed for real is then "in A"), at what their growth costs
    (:func:`analyzer.compare_gate.grown`), where that is above ``pct`` percent (never without
    it): a culprit of A that B makes at about A's severity did not change."""
    found = report["findings"]
    out = [f for f in found["appeared"] if f["kind"] in CULPRIT_KINDS]
    if pct is None:
        return out
    for f in found.get("kept", []):
        s = compare_gate.grown(f["a_severity"], f["severity"])
        if f["kind"] in CULPRIT_KINDS and compare_gate.price(s, 100.0) > pct:
            out.append({**f, "severity": s})
    return out


def evidence_severity(report: dict[str, Any], ranks: list[int], pct: float | None = None) -> float:
    """The largest severity of the culprits (:func:`culprits`) that name one of the evidence's
    ``ranks`` (NaN where none does): the gate's price of that evidence."""
    found = culprits(report, pct)
    severities = [float(f["severity"]) for f in found if set(f["ranks"]) & set(ranks)]
    return max(severities) if severities else float("nan")


def stage_evidence(a: Side, b: Side, report: dict[str, Any]) -> tuple[list[int], float]:
    """The ranks of a pipeline stage that a ``stage_imbalance`` finding of B names and whose
    compute over the other stages' (:attr:`Side.stages`) grew from A to B by at least a margin,
    and the share of B's median step that undoing the growth saves (its compute in B times
    ``1 - 1/growth``; NaN where no stage grew). The ratio is read in CPU time where both runs
    counted it (a CPU device), with :data:`CPU_STAGE_GROWTH` as the margin, else in wall time
    with the detector's (10%): on shared cores a healthy stage's ratio in wall time moves by
    9% from run to run, in CPU time by 3-4% (docs/benchmarks.md). With one rank per stage a
    slow rank is its stage: no straggler names it (no peer does its work); a stage's ratio to
    the others, read within each run, holds whatever the run-to-run drift moves every stage
    by. A stage that waits longer in B (its ratio in wall time grown by the detector's margin
    more than in CPU time: over 20 twins on shared cores the one over the other moved by
    3.6%, sd) is read in wall time, at the detector's margin. A stage that computes longer in
    every run (the last, with the head and the loss) does not grow: named, it is no
    evidence."""
    named = {int(f["evidence"]["stage"]): f for f in b.report["findings"]
             if f["kind"] == "stage_imbalance" and "stage" in (f.get("evidence") or {})}  # fmt: skip
    if not named:
        return [], float("nan")
    step_b = float(report["step"].get("b_ms") or "nan") * 1e6
    ranks: list[int] = []
    saved = float("nan")
    for stage, f in named.items():
        if stage not in a.stages.index or stage not in b.stages.index:
            continue
        grew, margin = _stage_growth(a.stages.loc[stage], b.stages.loc[stage])
        if not grew >= margin:
            continue
        compute_b = float(f["evidence"].get("compute_ms_per_step") or "nan") * 1e6
        ranks += f["ranks"]
        saved = np.nanmax([saved, compute_b * (1 - 1 / grew) / step_b])
    return sorted(set(ranks)), saved


def _stage_growth(a: pd.Series, b: pd.Series) -> tuple[float, float]:
    """A stage's ratio in B over its ratio in A (rows of :attr:`Side.stages`) and the growth
    that is evidence there (:func:`stage_evidence`): in CPU time where both have one, unless
    its ratio in wall time grew by the detector's margin more than in CPU time (the stage
    waited longer, not worked longer: a sleep, a slower device or disk), then in wall time."""
    wall, margin = float(b.ratio / a.ratio), 1 + Thresholds().stage_excess
    if not (np.isfinite(a.cpu_ratio) and np.isfinite(b.cpu_ratio)):
        return wall, margin
    cpu = float(b.cpu_ratio / a.cpu_ratio)
    if wall >= margin * cpu:
        return wall, margin
    return cpu, 1 + CPU_STAGE_GROWTH


def compare_sides(
    a: Side | Sequence[Side],
    b: Side,
    *,
    fail_above: float | None = None,
    drift_prior: float = compare_gate.DRIFT_PRIOR,
) -> dict[str, Any]:
    """The report of ``megascope compare`` (module docstring, docs/spec.md §4). ``a``: one
    reference run, or several baseline runs pooled (:func:`pool`)."""
    refs = [a] if isinstance(a, Side) else list(a)
    if not refs:
        raise CompareError("no reference run to compare with")
    a = pool(refs)
    run_a, run_b = _run_series(a), _run_series(b)
    base = float(run_a["step"].median()) if not run_a.empty else float("nan")
    floor_ns = FLOOR_SHARE * base if np.isfinite(base) else 0.0
    run_d = _diffs(run_a, run_b, alone=("step",))  # the step time stands alone
    step = row(run_d["step"], floor_ns)
    phases = [{"phase": p, **row(run_d[p], floor_ns)} for p in PHASES]
    kinds = []
    for key, d in sorted(_diffs(_kind_series(a), _kind_series(b)).items()):
        group, _, op = key.partition(" ")
        kinds.append({"group": group, "op": op, **row(d, floor_ns)})
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "a": _run_info(a),
        "b": _run_info(b),
        "noise": {
            "method": "bootstrap over steps, difference of medians",
            "level": LEVEL,
            "resamples": RESAMPLES,
            "seed": SEED,
            "floor_ms": _ms(floor_ns),
        },  # fmt: skip
        "verdict": step["verdict"] if changed(step) else NO_DIFFERENCE,
        "step": step,
        "phases": phases,
        "collectives": kinds,
        "ranks": _ranks(a, b, floor_ns),
        "findings": side_by_side(a.report, b.report),
    }
    # the rank whose own work moved most first: the one that changed, before those that moved
    # a little with it (a peer that sped up while a slowed rank left it the cores)
    changed_ranks = [r for r in report["ranks"] if r["changed"]]
    changed_ranks.sort(key=lambda r: -abs(r["own"]["diff_ms"] or 0.0) if "own" in r else 0.0)
    report["changed_ranks"] = [r["rank"] for r in changed_ranks]
    report["waiting_ranks"] = [r["rank"] for r in report["ranks"] if r["waited"]]
    report["notes"] = _notes(report)
    report["per_step"] = {"a": _per_step(run_a), "b": _per_step(run_b)}
    if len(refs) > 1:
        report["a"]["runs"] = [s.path for s in refs]
    if fail_above is not None:
        series = [_run_series(s)["step"].to_numpy(dtype=float) for s in refs]
        ranks = evidence(report, fail_above)
        severity = evidence_severity(report, ranks, fail_above)
        stage_ranks, stage_saved = stage_evidence(a, b, report)
        if stage_ranks:
            ranks = sorted({*ranks, *stage_ranks})
            severity = float(np.nanmax([severity, stage_saved]))
        work = None
        if all(len(s.cpu) for s in [*refs, b]):  # a CPU device: the ranks' CPU time a step
            work = ([s.cpu for s in refs], b.cpu)
        gate = compare_gate.decide(series, run_b["step"].to_numpy(dtype=float), fail_above,
                                   ranks, drift_prior, severity, work)  # fmt: skip
        report["fail_above"] = compare_gate.as_json(gate)
    return report


def _per_step(series: pd.DataFrame) -> list[dict[str, Any]]:
    """The run-wide series, one object per step (``step`` and each quantity in ms)."""
    out = []
    for step, values in series.iterrows():
        out.append({"step": int(step), **{f"{k}_ms": _ms(float(v)) for k, v in values.items()}})
    return out


def _notes(report: dict[str, Any]) -> list[str]:
    """What the reader must know to read the ranks: meshes that differ, ranks in one run."""
    a, b = report["a"], report["b"]
    if (a["world_size"], a["mesh"]) == (b["world_size"], b["mesh"]):
        return []

    def shape(run: dict[str, Any]) -> str:
        mesh = " x ".join(f"{k}={v}" for k, v in run["mesh"].items() if v and v > 1)
        return f"{run['world_size']} ranks ({mesh or '1 rank'})"

    alone = [r["rank"] for r in report["ranks"] if r["step"]["verdict"].startswith("only")]
    return [
        f"the runs' layouts differ (A: {shape(a)}, B: {shape(b)}): ranks are compared by "
        f"number, not by place in the mesh; {len(alone)} rank(s) are in one run only"
    ]


def _run_info(side: Side) -> dict[str, Any]:
    run = side.report["run"]
    return {"path": side.path, "world_size": run["world_size"], "mesh": run["mesh"],
            "steps": run["steps"], "median_step_ms": run["median_step_ms"]}  # fmt: skip


def compare(
    a: Run | Sequence[Run],
    b: Run,
    *,
    whatif: bool = True,
    fail_above: float | None = None,
    drift_prior: float = compare_gate.DRIFT_PRIOR,
) -> dict:
    """Compare opened runs: A the reference (one run, or several baseline runs), B the one
    asked about (module docstring)."""
    refs = [a] if isinstance(a, Run) else list(a)
    sides = [read_side(r, whatif=whatif) for r in refs]
    return compare_sides(
        sides, read_side(b, whatif=whatif), fail_above=fail_above, drift_prior=drift_prior
    )
