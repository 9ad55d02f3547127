"""Replaying a step graph with given durations, every step at once.

``Replayer(graph).run(d)`` takes ``d[slot, step]``: a compute slot's duration, a collective
member's transfer time (the time from the last member's arrival to its end), and returns each
step's time: the last end over every rank, each step starting from zero. Nodes are visited level
by level (:func:`analyzer.whatif.graph.build_graph`), each level one vectorized pass over its
slots and groups for all steps, so the cost is a few passes over ``slots x steps`` numbers.

This is also the engine of a simulator: give it durations that were generated instead of
measured (the synth's 1F1B graph with lognormal compute times) and it plays the steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from analyzer.whatif.graph import Graph


@dataclass
class _Level:
    comp: np.ndarray  # compute slots
    arr: np.ndarray  # collective members (their arrival)
    pred: np.ndarray  # of comp then arr
    cont: np.ndarray
    frac: np.ndarray
    has_pred: np.ndarray
    has_cont: np.ndarray
    members: np.ndarray  # of the level's groups, group after group
    offsets: np.ndarray  # first member of each group in ``members``
    sizes: np.ndarray


class Replayer:
    """A graph's levels prepared once for many replays."""

    def __init__(self, graph: Graph) -> None:
        self.n = len(graph.slots)
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
            self.levels.append(
                _Level(comp, arr, pred, cont, graph.frac[both].astype(np.float32)[:, None],
                       pred >= 0, cont >= 0, members, offs, sizes)
            )  # fmt: skip

    def run(self, d: np.ndarray, keep: bool = False) -> np.ndarray | tuple:
        """Step times (``(steps,)``) for durations ``d`` (``(slots, steps)``); with ``keep``
        also every slot's start and end."""
        steps = d.shape[1]
        start = np.zeros((self.n, steps), dtype=np.float32)
        end = np.zeros((self.n, steps), dtype=np.float32)
        for lv in self.levels:
            k = len(lv.comp) + len(lv.arr)
            if k:
                ready = np.zeros((k, steps), dtype=np.float32)
                if lv.has_pred.any():
                    ready[lv.has_pred] = end[lv.pred[lv.has_pred]]
                if lv.has_cont.any():
                    c = lv.cont[lv.has_cont]
                    s0 = start[c]
                    at = s0 + lv.frac[lv.has_cont] * (end[c] - s0)
                    np.maximum(ready[lv.has_cont], at, out=at)
                    ready[lv.has_cont] = at
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
        times = end.max(axis=0) if self.n else np.zeros(steps, dtype=np.float32)
        return (times, start, end) if keep else times
