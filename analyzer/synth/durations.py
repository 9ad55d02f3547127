"""A step's generated durations, ``d[block, j]`` for every block of the step graph.

* compute takes ``base * work factor * fraction * lasting factor * step factor * noise``, with
  lognormal noise of sigma ``noise`` (the work factor: forwards and backwards only; it is the
  ``--work-imbalance`` draw times the work the rank was given, :mod:`analyzer.synth.work`);
* a collective's members all carry their group's transfer time ``(latency + bytes *
  busbw_factor(n) / bandwidth) * slow_link * noise`` (nccl-tests factors: all_reduce
  2(n-1)/n, all_gather and reduce_scatter (n-1)/n; noise of sigma ``noise / 2``), the replay
  ending the group at its last arrival plus that;
* a pipeline transfer ``(latency + bytes / bandwidth) * slow_link * noise``, on both sides;
* data ``data_ms * noise + slow_data``, the pause (``pause`` faults, on their steps), the gate
  (infinite where a hang or crash fires).

The step's random numbers are drawn in one call, in the order the graph recorded them (the
order of a walk through the schedule), so a run is a function of its seed.
"""

from __future__ import annotations

import numpy as np

from analyzer.synth.cluster import Cluster
from analyzer.synth.config import SynthConfig
from analyzer.synth.stepgraph import COLL, COMP, DATA, GATE, OPT, PAUSE, RECV, StepGraph
from analyzer.synth.work import WorkModel


def _draw_index(sg: StepGraph, blocks: np.ndarray, count: int) -> np.ndarray:
    """Where each of ``blocks``' ``count`` random numbers sits in the step's draws."""
    first = np.array([sg.blocks[b].draw for b in blocks], dtype=np.int64)
    return first[:, None] + np.arange(count)[None, :]


class Durations:
    """The static parts of every block's duration, and each step's (see the module docstring)."""

    def __init__(self, cfg: SynthConfig, cl: Cluster, sg: StepGraph, rng: np.random.Generator):
        self.cfg, self.cl, self.rng, self.R = cfg, cl, rng, sg.R
        self.work_rng = np.random.default_rng([cfg.seed, 0x5EED])  # its own stream
        self.given = WorkModel(cfg, cl)  # the work rows, and the compute they cause
        m, blocks = cfg.model, sg.blocks
        kind = np.array([b.kind for b in blocks])
        self.stage = np.array([b.stage for b in blocks], dtype=np.int64)
        self.n = len(blocks)
        noisy = cfg.noise > 0
        self.sigma = np.concatenate(
            [np.full(c, cfg.noise / 2 if half else cfg.noise) for _, c, half in sg.draws]
        ) if sg.draws else np.zeros(0)  # fmt: skip
        # compute: (base * work) * fraction * lasting factor
        self.comp = np.flatnonzero((kind == COMP) | (kind == OPT))
        self.base = np.array([blocks[b].seconds for b in self.comp])[:, None]
        self.frac = np.array([blocks[b].fraction for b in self.comp])[:, None]
        self.comp_work = np.array([blocks[b].work for b in self.comp])
        self.lasting = cl.compute.reshape(cl.pp, -1)[self.stage[self.comp]]
        self.comp_s = self.base * self.frac * self.lasting  # without a work factor
        self.comp_draw = _draw_index(sg, self.comp, self.R) if noisy else None
        # data and pause, slow_data
        self.data = np.flatnonzero(kind == DATA)
        self.data_s = m.data_ms / 1e3
        self.data_draw = _draw_index(sg, self.data, self.R) if noisy else None
        self.slow_data = np.zeros((cl.pp, self.R))
        for f in cfg.faults:
            if f.kind == "slow_data":
                self.slow_data.reshape(-1)[f.rank] += f.ms / 1e3
        self.pause = np.flatnonzero(kind == PAUSE)
        self.gate = np.flatnonzero(kind == GATE)
        # collectives: each axis' groups, (latency + bytes x bus / bandwidth) * slow link
        self.coll = []
        axis_name = {0: "dp", 1: "cp", 2: "tp"}
        for ax in range(3):
            sel = np.flatnonzero(
                (kind == COLL) & np.array([blocks[b].axis == ax for b in range(self.n)])
            )
            if not len(sel):
                continue
            a = axis_name[ax]
            bw = cl.bandwidth[a].reshape(cl.pp, -1)[self.stage[sel]]
            link = cl.link[a].reshape(cl.pp, -1)[self.stage[sel]]
            nbb = np.array([blocks[b].seconds for b in sel])[:, None]
            xfer = (m.latency_s + nbb / bw) * link
            draw = _draw_index(sg, sel, bw.shape[1]) if noisy else None
            self.coll.append((sel, xfer, draw, sg.group_of(ax)))
        # pipeline transfers: both sides of a pair carry the transfer time
        self.recv = np.flatnonzero(kind == RECV)
        self.send = np.array([blocks[b].pair for b in self.recv], dtype=np.int64)
        xfer = np.empty((len(self.recv), self.R))
        for i, b in enumerate(self.recv):
            hop = blocks[b].link
            if hop >= 0:
                bw, slow = cl.p2p_bandwidth[hop], cl.p2p_link[hop]
            else:
                bw, slow = cl.wrap_bandwidth, cl.wrap_link
            xfer[i] = ((m.latency_s + sg.p2p_bytes / bw) * slow).reshape(-1)
        self.p2p = xfer
        self.p2p_draw = _draw_index(sg, self.recv, self.R) if noisy else None

    # ----------------------------------------------------------------- the step's conditions

    def _per_rank(self, fill: float = 0.0, dtype: type = np.float64) -> np.ndarray:
        return np.full((self.cl.pp, self.R), fill, dtype=dtype)

    def _factors(self, step: int) -> np.ndarray:
        """Compute factors that change with the step: GPU throttling, a regression drift and a
        slow_rank that starts at a later step."""
        cfg = self.cfg
        drift = 1.0 + (cfg.extras.regression - 1.0) * step / max(1, cfg.steps - 1)
        factors = self._per_rank(drift)
        for rank, factor, from_step in cfg.extras.throttle:
            if step >= from_step:
                factors.reshape(-1)[rank] *= factor
        for f in cfg.faults:
            if f.kind == "slow_rank" and 0 < f.step <= step:
                factors.reshape(-1)[f.rank] *= f.factor
        return factors

    def _work(self, step: int) -> np.ndarray | None:
        """This step's forward/backward factor of each stage position: each dp rank's draw
        of ``extras.work_imbalance`` (the same on every stage, cp and tp rank of that dp rank)
        times the work it was given (:class:`WorkModel`, which records it); None when even."""
        sigma = self.cfg.extras.work_imbalance
        per_dp = None
        if sigma > 0:
            per_dp = self.work_rng.lognormal(0.0, sigma, size=self.cl.shape[0])
        given = self.given.step(step, per_dp)
        if per_dp is None:
            return given
        drawn = np.repeat(per_dp, self.R // self.cl.shape[0])
        return drawn if given is None else drawn * given

    def _pauses(self, step: int) -> np.ndarray:
        """Seconds of pause (a GC-like stall) each rank takes as ``step`` begins:
        ``pause:rank=R,every=N,ms=M`` fires on steps ``N, 2N, ...`` (as the trainer does)."""
        out = self._per_rank()
        for f in self.cfg.faults:
            if f.kind == "pause" and step > 0 and step % f.every == 0:
                out.reshape(-1)[f.rank] += f.ms / 1e3
        return out

    def _blocked(self, step: int) -> np.ndarray:
        """The ranks whose hang or crash fires in ``step``."""
        out = self._per_rank(False, bool)
        for f in self.cfg.faults:
            if f.kind in ("hang", "crash") and f.step == step:
                out.reshape(-1)[f.rank] = True
        return out

    # ----------------------------------------------------------------- the step

    def step(self, step: int) -> np.ndarray:
        """``d[block, j]`` of ``step``."""
        factors, work, pauses, blocked = (
            self._factors(step), self._work(step), self._pauses(step), self._blocked(step)
        )  # fmt: skip
        z = self.rng.lognormal(0.0, self.sigma) if self.sigma.size else None

        def noise(draw: np.ndarray | None) -> np.ndarray | float:
            return 1.0 if z is None else z[draw]

        d = np.empty((self.n, self.R))
        if work is None:
            dur = self.comp_s.copy()
        else:
            sec = np.where(self.comp_work[:, None], self.base * work[None, :], self.base)
            dur = sec * self.frac * self.lasting
        if (factors != 1.0).any():  # (x * 1.0 is x: skipping it changes nothing)
            dur *= factors[self.stage[self.comp]]
        if z is not None:
            dur *= z[self.comp_draw]
        d[self.comp] = dur
        data = self.data_s * noise(self.data_draw)
        d[self.data] = data + self.slow_data[self.stage[self.data]]
        d[self.pause] = pauses[self.stage[self.pause]]
        d[self.gate] = np.where(blocked[self.stage[self.gate]], np.inf, 0.0)
        for sel, xfer, draw, gid in self.coll:
            d[sel] = (xfer * noise(draw))[:, gid]
        p2p = self.p2p * noise(self.p2p_draw)
        d[self.recv] = p2p
        d[self.send] = p2p
        return d
