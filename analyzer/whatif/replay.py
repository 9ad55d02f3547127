"""Replaying a step graph with given durations, every step at once.

``Replayer(graph).run(d)`` takes ``d[slot, step]``: a compute slot's duration, a collective
member's transfer time (the time from the last member's arrival to its end), and returns each
step's time: the last end over every rank, each step starting from zero. Nodes are visited level
by level (:func:`analyzer.whatif.graph.build_graph`), each level one vectorized pass over its
slots and groups for all steps, so the cost is a few passes over ``slots x steps`` numbers.

It is also the engine of the simulator (:mod:`analyzer.synth`): the synth builds its step's
graph from the schedule (:func:`analyzer.whatif.graph.graph_from_arrays`), generates the
durations instead of measuring them, replays in float64 and starts each rank's step where its
previous step ended (``origin``). An infinite duration (a hang) carries through ``+`` and
``max`` to every node that waits on it; ``cont`` dependencies (which the synth has none of)
would need finite times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, overload

import numpy as np

from analyzer.whatif.graph import Graph


@dataclass
class _Level:
    comp: np.ndarray  # compute slots
    arr: np.ndarray  # collective members (their arrival)
    pred_at: np.ndarray | None  # positions (in comp then arr) with a predecessor; None: all
    pred: np.ndarray  # their predecessors
    cont_at: np.ndarray  # positions with a ``cont`` dependency
    cont: np.ndarray
    frac: np.ndarray
    members: np.ndarray  # of the level's groups, group after group
    offsets: np.ndarray  # first member of each group in ``members``
    sizes: np.ndarray
    roots: np.ndarray  # positions of the slots with no predecessor
    root_rank: np.ndarray  # their ranks (to read ``origin``)


class Replayer:
    """A graph's levels prepared once for many replays (times in ``dtype``)."""

    def __init__(self, graph: Graph, dtype: type = np.float32) -> None:
        self.n = len(graph.slots)
        self.dtype = dtype
        is_comp = graph.group < 0
        self.levels: list[_Level] = []
        for slots, groups in graph.levels:
            comp = slots[is_comp[slots]]
            arr = slots[~is_comp[slots]]
            both = np.concatenate([comp, arr])
            if len(groups):
                lo = graph.member_start[groups]
                sizes = graph.member_start[groups + 1] - lo
                offs = np.cumsum(sizes) - sizes
                members = graph.members[
                    np.repeat(lo, sizes) + np.arange(sizes.sum()) - np.repeat(offs, sizes)
                ]
            else:
                sizes = offs = members = np.zeros(0, dtype=np.int64)
            pred, cont = graph.pred[both], graph.cont[both]
            pred_at, cont_at, roots = (np.flatnonzero(x) for x in (pred >= 0, cont >= 0, pred < 0))
            frac = graph.frac[both[cont_at]].astype(np.float32)[:, None]
            self.levels.append(
                _Level(comp, arr, None if len(pred_at) == len(both) else pred_at, pred[pred_at],
                       cont_at, cont[cont_at], frac, members, offs, sizes, roots,
                       graph.slots.rank[both[roots]])
            )  # fmt: skip

    @overload
    def run(
        self, d: np.ndarray, keep: Literal[False] = False, origin: np.ndarray | None = None
    ) -> np.ndarray: ...

    @overload
    def run(
        self, d: np.ndarray, keep: Literal[True], origin: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...

    @overload
    def run(
        self, d: np.ndarray, keep: bool, origin: np.ndarray | None = None
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray, np.ndarray]: ...

    def run(
        self, d: np.ndarray, keep: bool = False, origin: np.ndarray | None = None
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Step times (``(steps,)``) for durations ``d`` (``(slots, steps)``); with ``keep``
        also every slot's start and end. ``origin[rank, step]`` (None: zero) is when each rank
        begins each step: its slots with no predecessor are ready then."""
        steps = d.shape[1]
        start: np.ndarray = np.zeros((self.n, steps), dtype=self.dtype)
        end: np.ndarray = np.zeros((self.n, steps), dtype=self.dtype)
        for lv in self.levels:
            k = len(lv.comp) + len(lv.arr)
            if k:
                if lv.pred_at is None:
                    ready = end[lv.pred]
                else:
                    ready = np.zeros((k, steps), dtype=self.dtype)
                    if origin is not None and len(lv.roots):
                        ready[lv.roots] = origin[lv.root_rank]
                    if len(lv.pred_at):
                        ready[lv.pred_at] = end[lv.pred]
                if len(lv.cont_at):
                    c = lv.cont
                    s0 = start[c]
                    at = s0 + lv.frac * (end[c] - s0)
                    np.maximum(ready[lv.cont_at], at, out=at)
                    ready[lv.cont_at] = at
                nc = len(lv.comp)
                if nc:
                    start[lv.comp] = ready[:nc]
                    end[lv.comp] = ready[:nc] + d[lv.comp]
                if len(lv.arr):
                    start[lv.arr] = ready[nc:]
            if len(lv.members):
                m = lv.members
                last = np.maximum.reduceat(start[m], lv.offsets, axis=0)
                xfer = np.maximum.reduceat(d[m], lv.offsets, axis=0)
                end[m] = np.repeat(last + xfer, lv.sizes, axis=0)
        times = end.max(axis=0) if self.n else np.zeros(steps, dtype=self.dtype)
        return (times, start, end) if keep else times
