"""Checkpoint stall: the steps that save a checkpoint are slower than their neighbours."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from analyzer.findings.common import Context, finding, ms, robust_sigma
from analyzer.findings.detector import DetectorSpec, Kind
from analyzer.findings.record import Finding

NEIGHBOURS = 5  # steps on each side whose median is a checkpoint step's reference
MEDIAN_SE = 1.2533  # the standard error of a median of k normal values: 1.2533 sigma/sqrt(k)


def detect(ctx: Context) -> list[Finding]:
    """Report checkpoints that hold training up, what they cost and whether async would help.

    Algorithm: a step's time is the median over ranks of its step time. A checkpoint step
    (one in which ranks have checkpoint spans, findings/checkpoint_steps.sql) is compared with
    the median of the other steps within ``NEIGHBOURS`` steps of it. Its *stall* is its excess
    over that reference, plus how much longer the slowest rank's checkpoint took in the step
    than the median rank's (the others wait that long for it at their next collective). The
    window's last step, when it saves, is left out: it holds a run's final checkpoint, after
    which no training waits. Checkpoints stall training when the median stall is at least
    ``stall_share`` of the time between two checkpoints (they cost 5% of the time or more) and
    ``z`` standard errors of such a median above zero, the noise being the robust sigma of the
    other steps' step-to-step changes over sqrt(2).

    Where the time goes, per checkpoint step (medians over ranks): the snapshot (the copy to
    host memory), the write inside the step (synchronous mode), the wait of a snapshot for the
    previous background write (asynchronous mode). Async would hide a synchronous write that
    is shorter than the time between checkpoints; an asynchronous write longer than that makes
    the next snapshot wait.

    Severity: the stalls' total over the total time of the analyzed steps (the share of the
    step time lost to checkpoints); ``lost_s_per_hour`` is the same per hour of training.
    """
    ck = ctx.checkpoints
    rs = ctx.all_rank_steps
    if ck.empty or rs.empty:
        return []
    per_step = rs.groupby("step").step_ns.median().sort_index().astype(float)
    saving = sorted(int(s) for s in ck.step.unique())
    plain = per_step[~per_step.index.isin(saving)]
    if len(plain) < 3:
        return []
    noise = robust_sigma(np.diff(plain.to_numpy())) / math.sqrt(2)
    ck = ck.assign(held_ns=ck.snapshot_ns + ck.persist_ns + ck.wait_ns)
    stalls = _stalls(per_step, plain, ck[ck.step < per_step.index.max()])
    if stalls.empty:
        return []
    median_step = float(plain.median())
    interval = _every(ctx, saving, len(per_step)) * median_step
    th = ctx.thresholds
    floor = max(th.stall_share * interval, th.z * MEDIAN_SE * noise / math.sqrt(len(stalls)))
    stall = float(stalls.median())
    if stall < floor:
        return []
    parts = ck[ck.step.isin(stalls.index)].groupby("step").median(numeric_only=True).median()
    share = float(stalls.clip(lower=0).sum()) / float(per_step.sum())
    ev = _evidence(stalls, parts, stall, floor, noise, interval, share)
    steps = [int(s) for s in stalls.index]
    return [finding(ctx, "checkpoint_stall", [], share, _message(ev, steps), ev, steps)]


def _stalls(per_step: pd.Series, plain: pd.Series, ck: pd.DataFrame) -> pd.Series:
    """Each checkpoint step's excess over its neighbours, plus the slowest rank's lag."""
    out = {}
    for s, ranks in ck.groupby("step"):
        if s not in per_step.index:  # no step time for it (its rows lost)
            continue
        near = plain[(plain.index >= s - NEIGHBOURS) & (plain.index <= s + NEIGHBOURS)]
        ref = float((near if len(near) >= 2 else plain).median())
        lag = float(ranks.held_ns.max() - ranks.held_ns.median())
        out[int(s)] = per_step[s] - ref + lag
    return pd.Series(out, dtype=float)


def _every(ctx: Context, saving: list[int], n_steps: int) -> float:
    """Steps between two checkpoints: the run's setting (run.json), else the median gap."""
    train = ctx.run.meta.get("train")
    every = train.get("checkpoint_every") if isinstance(train, dict) else None
    if isinstance(every, int) and every > 0:
        return float(every)
    gaps = np.diff(saving)
    return float(np.median(gaps)) if len(gaps) else float(n_steps)


def _evidence(
    stalls: pd.Series,
    parts: pd.Series,
    stall: float,
    floor: float,
    noise: float,
    interval: float,
    share: float,
) -> dict[str, Any]:
    snapshot, write = float(parts.snapshot_ns), float(parts.persist_ns)
    wait, background = float(parts.wait_ns), float(parts.background_ns)
    held = snapshot + write + wait
    mode = "sync" if write > 0 else "async"
    hides = write > 0 and write < interval
    return {
        "checkpoint_steps": [int(s) for s in stalls.index],
        "stall_ms": ms(stall),
        "threshold_ms": ms(floor),
        "noise_ms": ms(noise),
        "lost_s_per_hour": round(share * 3600, 1),
        "mode": mode,
        "snapshot_ms": ms(snapshot),
        "persist_ms": ms(write),
        "wait_ms": ms(wait),
        "background_persist_ms": ms(background),
        "persist_share": round((write + wait) / held, 3) if held > 0 else None,
        "interval_ms": ms(interval),
        "async_would_hide": bool(hides),
    }


def _message(ev: dict[str, Any], steps: list[int]) -> str:
    shown = f"{steps[:8]}" + ("…" if len(steps) > 8 else "")
    head = (
        f"checkpoints stall training: steps {shown} take {ev['stall_ms']:g} ms longer than "
        f"their neighbours (median; noise {ev['noise_ms']:g} ms), {ev['lost_s_per_hour']:g} s "
        "per hour of training"
    )
    share = ev["persist_share"] or 0.0
    if ev["mode"] == "sync" and ev["async_would_hide"]:
        return (
            f"{head}; the write is {share:.0%} of it, which --checkpoint-async would hide "
            f"({ev['persist_ms']:g} ms, less than the time between checkpoints); the snapshot "
            f"({ev['snapshot_ms']:g} ms) would remain"
        )
    if ev["mode"] == "sync":
        return (
            f"{head}; the write is {share:.0%} of it and takes longer ({ev['persist_ms']:g} ms) "
            "than the time between checkpoints: --checkpoint-async would hide only part of it"
        )
    if ev["wait_ms"] > ev["snapshot_ms"]:
        return (
            f"{head}; each snapshot waits for the previous background write "
            f"({ev['background_persist_ms']:g} ms, longer than the time between checkpoints): "
            "a faster disk or checkpoints further apart would hide it"
        )
    return (
        f"{head}; the snapshot (the copy to host memory, {ev['snapshot_ms']:g} ms) is most of "
        "it, which writing in the background cannot hide"
    )


DETECTOR = DetectorSpec("checkpoint_stall", detect, (Kind("checkpoint_stall"),))
