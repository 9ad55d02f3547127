"""Hardware imbalance: one hardware class computes slower than the others at the same work."""

from __future__ import annotations

import numpy as np
import pandas as pd

from analyzer.findings.common import Context, finding, ms
from analyzer.findings.detector import DetectorSpec, Kind, Replay
from analyzer.findings.record import Finding

# a rank's class of work: ranks of one pipeline stage and context shard do the same work
CELL = ["step", "pp", "cp"]


def class_ratios(ctx: Context) -> tuple[pd.DataFrame, str]:
    """Per (step, class): the class's median own work over the other classes' at the same
    work (``ratio``, ``excess_ns``), and how the classes were compared (``same stage`` or
    ``across stages``). Empty where the run names fewer than two classes.

    Same work is a (step, pipeline stage, context shard) cell: in each cell that holds ranks
    of two classes or more, each class's median ``work_ns`` (step time less collectives and
    data loading, as the straggler detector reads it) is divided by the median of the other
    classes' medians there, and a class's ratio in a step is the median over its cells. Where
    no cell mixes classes (classes cut along pipeline stages), each stage's median is its
    class's time in that stage and the classes' medians over their stages are compared
    instead: stages of a uniform split run the same layers."""
    rs = ctx.rank_steps
    empty = pd.DataFrame(columns=["step", "hw", "ratio", "excess_ns", "ranks"])
    if rs.empty or "hw" not in rs or ctx.n_steps < 3:
        return empty, ""
    rs = rs[(rs.work_ns > 0) & (rs.hw != "")]
    if rs.hw.nunique() < 2:
        return empty, ""
    cells = rs.groupby([*CELL, "hw"]).work_ns.median().rename("work").reset_index()
    mixed = cells.groupby(CELL).hw.transform("nunique") >= 2
    if mixed.any():
        cells, how, keys = cells[mixed], "same stage", CELL
    else:  # one class per stage: the classes' stages compared with each other
        cells = cells.groupby(["step", "hw"]).work.median().reset_index()
        how, keys = "across stages", ["step"]
    total = cells.groupby(keys).work.transform("sum")
    count = cells.groupby(keys).work.transform("size")
    # the other classes' median: with two classes, the other one's; more, their mean
    others = (total - cells.work) / (count - 1)
    cells = cells.assign(ratio=cells.work / others, excess_ns=cells.work - others)
    per = cells.groupby(["step", "hw"]).agg(
        ratio=("ratio", "median"), excess_ns=("excess_ns", "median")
    )
    return per.reset_index(), how


def detect(ctx: Context) -> list[Finding]:
    """Name a hardware class that computes slower than the run's other classes.

    Algorithm: each rank's class is topology's ``hw_class`` (the tracer's label, or ``synth
    --hw-classes``). Per step, each class's own work is compared with the other classes' at
    the same work (:func:`class_ratios`). A class is slower when its median ratio over the
    steps is at least 1 + ``min_excess`` and above 1 + ``min_excess``/2 in ``persistence`` of
    the steps, as a straggler must be; its ranks are then compared with peers of their own
    class only (the straggler detector's peer classes hold ``hw``), so they are not also
    stragglers, and a straggler inside a faster class is still named among its own.

    Severity (estimate): the slow class at the faster classes' speed: its median excess of
    own work per step over the median step (every step waits for its slowest ranks at the
    data-parallel synchronization, or runs at its slowest stage's pace). With the what-if, its
    ranks' compute is replayed at what the other classes took (analyzer.findings.severity.cost).
    """
    th = ctx.thresholds
    per, how = class_ratios(ctx)
    if per.empty:
        return []
    agg = (
        per.assign(late=per.ratio >= 1 + th.min_excess / 2)
        .groupby("hw")
        .agg(
            n=("ratio", "size"),
            ratio=("ratio", "median"),
            excess_ns=("excess_ns", "median"),
            late_frac=("late", "mean"),
        )
    )
    slow = agg[(agg.n >= 3) & (agg.ratio >= 1 + th.min_excess) & (agg.late_frac >= th.persistence)]
    out = []
    rs = ctx.rank_steps
    members = rs.groupby("hw")["rank"].unique()
    for hw, row in slow.iterrows():
        ranks = sorted(int(r) for r in members[hw])
        others = sorted(str(h) for h in members.index if h and h != hw)
        msg = (
            f"hardware class {hw} ({len(ranks)} ranks: {spans(ranks)}) computes "
            f"{row.ratio:.2f}x as long as {', '.join(others)} at the same work ({how}), "
            f"{ms(row.excess_ns)} ms more per step, in {round(row.late_frac * row.n)} of "
            f"{int(row.n)} steps; its ranks are compared with their own class for stragglers"
        )
        ev = {
            "hw_class": hw,
            "other_classes": others,
            "time_ratio": row.ratio,
            "excess_ms_per_step": ms(row.excess_ns),
            "late_steps": round(row.late_frac * row.n),
            "steps_compared": int(row.n),
            "compared": how,
            "class_ranks": len(ranks),
            "rank_ranges": spans(ranks),
        }
        sev = row.excess_ns / ctx.median_step_ns
        out.append(finding(ctx, "hardware_imbalance", ranks, sev, msg, ev))
    return out


def spans(ranks: list[int]) -> str:
    """``0-6143, 8000`` : sorted ranks as ranges."""
    out: list[str] = []
    start = prev = None
    for r in ranks:
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
        start = prev = r
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ", ".join(out)


def absorbed(findings: list[Finding]) -> list[Finding]:
    """``findings`` without the stage imbalances of a slower class: a stage whose ranks are all
    of a class named by a ``hardware_imbalance`` (classes cut along pipeline stages) is that
    class's slowness, which the class's finding names."""
    classes = [set(f["ranks"]) for f in findings if f["kind"] == "hardware_imbalance"]
    return [
        f
        for f in findings
        if not (f["kind"] == "stage_imbalance" and any(set(f["ranks"]) <= c for c in classes))
    ]


def fix(replay: Replay, f: Finding) -> np.ndarray:
    """Fixed in the what-if replay: the compute of the class's ranks."""
    return replay.ranks_compute(f["ranks"])


DETECTOR = DetectorSpec("hardware_imbalance", detect, (Kind("hardware_imbalance", fix=fix),))
