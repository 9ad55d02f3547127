"""The straggler finding's words and evidence: one wording per signal that named the rank (its
late arrival, its CPU time alone, its own time), and the numbers behind it (docs/spec.md §3).

:mod:`analyzer.findings.straggler` decides who is a straggler and what it costs; this module
only says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from analyzer.findings.common import ms
from analyzer.findings.record import Evidence


@dataclass(frozen=True)
class Cost:
    """What a straggler costs per step (ns) and the arrivals behind the cap."""

    per_step: float  # its excess per step, capped by its arrival blame where it has one
    blame_per_step: float  # what its peers waited for it alone, per step (ns)
    n_in: int  # collective instances of two or more members it took part in
    last_share: float  # the share of those it arrived last at (NaN where none)
    blame_beyond_peers: float  # that blame beyond its peers' median blame, per step (ns)


@dataclass(frozen=True)
class Shape:
    """Who the straggler is, against whom, and what named it."""

    label: str  # "rank 5 (dp1 pp0 tp1, node3)"
    factor: float  # how many times slower (the signal's ratio)
    peers: int  # peers in its class
    same: str  # what its peers share with it (:func:`same_peers`)
    signal: str  # late_arrival | cpu_time | own_time


def same_peers(cp: object, row: pd.Series) -> str:
    """What a rank's peers share with it: its stage, its context shard, its hardware class."""
    same = "same pipeline stage" + (
        "" if cp == 1 else " and context shard" if row.shard >= 0 else ", other context shards"
    )
    if row.hw:
        same += f", hardware class {row.hw}"
    return same


def message(
    s: Shape, row: pd.Series, late: pd.Series | None, cpu: pd.Series | None, c: Cost
) -> str:
    """The finding's message: what named the rank, then its arrivals and its peers' waits."""
    head = f"{s.label} computes {s.factor:.2f}x slower than its {s.peers} peers ({s.same}): "
    if s.signal == "late_arrival" and late is not None:
        fwd = late.forward_ratio
        msg = (
            head + f"they wait for it inside their own backward, where it arrived at "
            f"the gradient collectives a median {ms(late.late_ns):.1f} ms "
            f"({late.late:.0%} of a step) after them (later in "
            f"{round(late.late_frac * late.n)} of {int(late.n)} steps); "
            + (f"its forward takes {fwd:.2f}x theirs, " if fwd == fwd else "")
            + f"its own time outside collectives and data loading {row.ratio:.2f}x"
        )
    elif s.signal == "cpu_time" and cpu is not None:
        msg = (
            head + f"its training thread's CPU time in a step is {s.factor:.2f}x "
            f"theirs (median over {int(cpu.n)} steps; more in "
            f"{round(cpu.late_frac * cpu.n)}), which no wait for a peer or for a shared core "
            f"lengthens; its step time outside collectives and data loading {row.ratio:.2f}x"
        )
    else:
        msg = (
            head + f"its step time outside collectives and data loading is "
            f"{row.ratio:.2f}x theirs (median over {int(row.n)} steps; longer in "
            f"{round(row.late_frac * row.n)})"
        )
        if cpu is not None:
            msg += f", its training thread's CPU time {float(cpu.ratio):.2f}x"
    waiters = row.peer_comm_ns / row.comm_ns if row.comm_ns > 0 else float("nan")
    if c.n_in:
        msg += f"; it arrived last at {c.last_share:.0%} of its collectives"
    if math.isfinite(waiters) and waiters > 1:
        msg += f", its peers spend {waiters:.1f}x longer waiting in collectives"
    return msg


def evidence(
    s: Shape, row: pd.Series, late: pd.Series | None, cpu: pd.Series | None, c: Cost
) -> Evidence:
    """The numbers behind the finding (its own time, its CPU time, its late arrival)."""
    ev: Evidence = {
        "work_ratio": s.factor,
        "late_steps": round(row.late_frac * row.n),
        "steps_compared": int(row.n),
        "excess_ms_per_step": ms(row.excess_ns),
        "peer_noise_sigma": row.sigma,
        "arrival_blame_ms_per_step": ms(c.blame_per_step),
        "arrival_blame_beyond_peers_ms_per_step": ms(c.blame_beyond_peers),
        "arrived_last_share": c.last_share,
        "comm_ms_per_step": ms(row.comm_ns),
        "peer_comm_ms_per_step": ms(row.peer_comm_ns),
        "peers": s.peers,
    }
    if row.hw:
        ev["hw_class"] = row.hw
    if cpu is not None:
        ev.update(
            cpu_ratio=float(cpu.ratio),
            cpu_steps=int(cpu.n),
            cpu_late_steps=round(cpu.late_frac * cpu.n),
            cpu_excess_ms_per_step=ms(cpu.excess_ns),
            cpu_noise_sigma=float(cpu.sigma),
            own_time_ratio=float(row.ratio),
        )
        if s.signal == "cpu_time":
            ev["signal"] = "cpu_time"
    if late is not None:
        ev.update(
            signal="late_arrival",
            own_time_ratio=row.ratio,
            lead_ratio=late.lead_ratio,
            forward_ratio=late.forward_ratio,
            late_z=late.late_z,
            forward_z=late.forward_z,
            late_ms_per_step=ms(late.late_ns),
            late_share=late.late,
            late_arrival_steps=round(late.late_frac * late.n),
            arrival_steps=int(late.n),
            late_noise_sigma=late.late_sigma,
        )
    return ev
