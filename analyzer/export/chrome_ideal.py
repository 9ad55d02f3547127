"""The ideal replay of a run as trace events, beside the measured timeline (``--ideal``).

The what-if (:mod:`analyzer.whatif`) replays every step on the run's dependency graph with each
operation at its typical duration; ``Replayer.run(typical, keep=True)`` gives every operation's
start and end in seconds after its step's zero (the step's first arrival on any rank). Here each
step of the replay is laid at its measured step's zero, so an ideal step starts where the
measured one does and its end shows what the step would take without stragglers.

Layout: one more process per rank (``pid`` = ``offset + rank``, ``offset`` the power of ten
above the largest rank, named ``rank 5 (ideal)``), sorted right after the rank's measured
process; in it the compute operations (spans, cut around the collectives they hold) on
``ideal compute`` threads and the collectives (arrival to end: waiting and transfer) on
``ideal collectives`` threads, dealt into lanes as the measured rows are (a compute piece of no
length, a span cut right at a collective, is left out). Slices carry the
step, the operation's peer key and its measured and ideal durations (a collective's duration
is its transfer time, from the last member's arrival). Steps the what-if leaves out (other
operations than the rest) have no ideal slices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

IDEAL_TID, IDEAL_COLL_TID = 3001, 4001
THREADS = {IDEAL_TID: "ideal compute", IDEAL_COLL_TID: "ideal collectives"}


@dataclass
class Ideal:
    """The replayed ideal timeline: per operation and step, absolute start and end (ns)."""

    rank: np.ndarray  # (slots,) int64
    name: list[str]  # (slots,) slice names
    key: list[str]  # (slots,) peer keys
    is_comm: np.ndarray  # (slots,) bool
    steps: np.ndarray  # (steps,) int64
    start_ns: np.ndarray  # (slots, steps) int64
    end_ns: np.ndarray
    measured_s: np.ndarray  # (slots, steps) float32: the what-if's durations (seconds)
    typical_s: np.ndarray
    slowdown: float
    left_out: list[int]

    def offset(self) -> int:
        """The pid offset of the ideal processes: the power of ten above the largest rank."""
        top = int(self.rank.max()) if len(self.rank) else 0
        return 10 ** len(str(top))


def replay_ideal(run_dir: str) -> Ideal:
    """Prepare the what-if of ``run_dir`` and replay it with typical durations; raises
    :class:`analyzer.whatif.WhatIfError` (one line) when the run cannot be replayed."""
    from analyzer.whatif import WhatIfError, prepare
    from analyzer.whatif.load import add_ops_view, opened

    with opened(run_dir) as run:
        w = prepare(run)
        if not len(w.steps):
            raise WhatIfError("no step to replay")
        ideal_t, start, end = w.replayer.run(w.typical, keep=True)
        measured_t = w.replay()
        add_ops_view(run)
        # each step's zero, as the what-if's reader takes it: its first arrival on any rank
        rows = run.retrying(
            lambda: run.con.execute(
                "select step, min(t0) from whatif_ops where step between $lo and $hi group by step",
                {"lo": int(w.steps.min()), "hi": int(w.steps.max())},
            ).fetchall()
        )
    zeros = {int(s): int(z) for s, z in rows if z is not None}
    missing = [int(s) for s in w.steps if int(s) not in zeros]
    if missing:
        raise WhatIfError(f"step {missing[0]} has no arrival to align the ideal replay to")
    zero = np.array([zeros[int(s)] for s in w.steps], dtype=np.int64)
    slots = w.graph.slots
    names = []
    for cls, op in zip(slots.cls, slots.op, strict=True):
        text = slots.ops[int(op)]
        if cls in (2, 3):  # "send/recv pp" -> "send pp" / "recv pp"
            text = ("send" if cls == 2 else "recv") + text[len("send/recv") :]
        names.append(text)

    def absolute(t: np.ndarray) -> np.ndarray:  # seconds after each step's zero -> ns, -1: none
        sec = t.astype(np.float64)
        ok = np.isfinite(sec)
        ns = np.rint(np.where(ok, sec, 0.0) * 1e9).astype(np.int64)  # before adding the zero:
        return np.where(ok, zero + ns, -1)  # float64 holds epoch ns to 256 ns only

    return Ideal(
        rank=slots.rank.astype(np.int64),
        name=names,
        key=[slots.keys[int(k)] for k in slots.key],
        is_comm=slots.cls > 0,
        steps=np.asarray(w.steps, dtype=np.int64),
        start_ns=absolute(start),
        end_ns=absolute(end),
        measured_s=w.measured,
        typical_s=w.typical,
        slowdown=float(np.mean(measured_t) / np.mean(ideal_t)) if np.mean(ideal_t) > 0 else 0.0,
        left_out=list(w.times.left_out),
    )


def write_ideal(w: Any, lanes: Any, ideal: Ideal) -> int:
    """Write the ideal processes' metadata and slices (``w``: the exporter's Writer, ``lanes``
    its Lanes); returns the number of slices."""
    offset = ideal.offset()
    for rank in np.unique(ideal.rank).tolist():
        w.meta("process_name", offset + rank, 0, {"name": f"rank {rank} (ideal)"})
        w.meta("process_sort_index", offset + rank, 0, {"sort_index": 2 * rank + 1})
    start, end = ideal.start_ns, ideal.end_ns
    ok = (start >= 0) & (end >= start)
    ok &= (end > start) | ideal.is_comm[:, None]  # not the empty pieces of a cut span
    slot, col = np.nonzero(ok)
    # each rank's slices in time order, so that the greedy lanes stay few
    order = np.lexsort((end[slot, col], start[slot, col], ideal.rank[slot]))
    n = 0
    for i in order.tolist():
        s, c = int(slot[i]), int(col[i])
        rank = int(ideal.rank[s])
        base = IDEAL_COLL_TID if ideal.is_comm[s] else IDEAL_TID
        a, b = int(start[s, c]), int(end[s, c])
        tid = lanes.take(offset + rank, base, a, b)
        args = {
            "step": int(ideal.steps[c]),
            "key": ideal.key[s],
            "measured_ms": round(float(ideal.measured_s[s, c]) * 1e3, 6),
            "ideal_ms": round(float(ideal.typical_s[s, c]) * 1e3, 6),
        }
        w.slice(offset + rank, tid, a, b, ideal.name[s], "ideal", args)
        n += 1
    return n
