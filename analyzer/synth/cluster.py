"""The simulated cluster's geometry: which ranks share a stage, a group, a host, a slow link.

The simulator lays each pipeline stage out as an array shaped ``(dp, cp, tp)``: in the SPEC's
rank order (pipeline outermost, tensor innermost) the ranks of stage ``s`` are the contiguous
block ``s * R .. (s + 1) * R - 1`` with ``R = dp * cp * tp``, and that block reshaped C-order is
exactly ``(dp, cp, tp)``. Every dp, cp and tp group lives inside one stage and is a line along
one axis of that array, so a per-group quantity is an array with that axis kept at length one
(flattened C-order: the group's number in :meth:`analyzer.synth.stepgraph.StepGraph.group_of`). Pipeline transfers connect the
same ``(dp, cp, tp)`` position of neighbouring stages.

This module turns the mesh and the faults into such arrays once: each rank's lasting compute
factor, each group's bandwidth (one host or several) and slow-link factor, and the same for the
pipeline links.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import overload

import numpy as np

from analyzer.synth.config import GPUS_PER_HOST, SynthConfig
from tracer.rundir import coords_of

# Array axis of each group kind inside a stage's (dp, cp, tp) array.
AXIS_OF = {"dp": 0, "cp": 1, "tp": 2}


@dataclass
class Cluster:
    """Per-stage arrays the step durations read; built by :func:`build_cluster`."""

    pp: int
    shape: tuple[int, int, int]  # (dp, cp, tp)
    ranks: np.ndarray  # (pp, dp, cp, tp) int64, the global rank at each position
    compute: np.ndarray  # (pp, dp, cp, tp) lasting compute factor (spread, slow_rank, imbalance)
    bandwidth: dict[str, np.ndarray]  # axis -> (pp, dp, cp, tp) with that axis of length 1
    link: dict[str, np.ndarray]  # axis -> slow_link factor, same shape as bandwidth
    p2p_bandwidth: np.ndarray  # (pp - 1, dp, cp, tp): stage s <-> s + 1
    p2p_link: np.ndarray  # (pp - 1, dp, cp, tp)
    wrap_bandwidth: np.ndarray  # (dp, cp, tp): last stage <-> first (interleaved pipelines)
    wrap_link: np.ndarray  # (dp, cp, tp)

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage: dp x cp x tp."""
        return int(np.prod(self.shape))


@overload
def host_of(rank: int) -> int: ...


@overload
def host_of(rank: np.ndarray) -> np.ndarray: ...


def host_of(rank: int | np.ndarray) -> int | np.ndarray:
    """The simulated host index of a rank (or of each rank of an array): ``GPUS_PER_HOST`` ranks per
    host, in rank order."""
    return rank // GPUS_PER_HOST


def _group_arrays(
    cfg: SynthConfig, ranks: np.ndarray, axis_name: str
) -> tuple[np.ndarray, np.ndarray]:
    """Bus bandwidth and slow-link factor of every group along one axis.

    A group whose members sit on one host talks over NVLink, any other over the network. A
    slow link ``A-B`` slows every group that holds both ``A`` and ``B``.
    """
    ax = AXIS_OF[axis_name] + 1
    hosts = host_of(ranks)
    one_host = hosts.max(axis=ax, keepdims=True) == hosts.min(axis=ax, keepdims=True)
    bw = np.where(one_host, cfg.model.nvlink_busbw, cfg.model.network_busbw).astype(np.float64)
    link = np.ones_like(bw)
    for f in cfg.faults:
        if f.kind != "slow_link":
            continue
        a, b = f.ranks
        ia = np.unravel_index(a, ranks.shape)
        ib = np.unravel_index(b, ranks.shape)
        others_equal = all(ia[k] == ib[k] for k in range(4) if k != ax)
        if others_equal:
            idx = tuple(0 if k == ax else ia[k] for k in range(4))
            link[idx] *= f.factor
    return bw, link


def _p2p_arrays(cfg: SynthConfig, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bandwidth and slow-link factor of each pipeline link (stage s to s + 1, same position)."""
    hosts = host_of(ranks)
    one_host = hosts[1:] == hosts[:-1]
    bw = np.where(one_host, cfg.model.nvlink_busbw, cfg.model.network_busbw).astype(np.float64)
    link = np.ones_like(bw)
    for f in cfg.faults:
        if f.kind != "slow_link":
            continue
        lo, hi = sorted(f.ranks)
        ilo = np.unravel_index(lo, ranks.shape)
        ihi = np.unravel_index(hi, ranks.shape)
        if ihi[0] == ilo[0] + 1 and ilo[1:] == ihi[1:]:
            link[ilo] *= f.factor
    return bw, link


def _wrap_arrays(cfg: SynthConfig, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bandwidth and slow-link factor of the link from the last stage back to the first (same
    position), which an interleaved pipeline uses between model chunks."""
    hosts = host_of(ranks)
    one_host = hosts[0] == hosts[-1]
    bw = np.where(one_host, cfg.model.nvlink_busbw, cfg.model.network_busbw).astype(np.float64)
    link = np.ones_like(bw)
    last = ranks.shape[0] - 1
    for f in cfg.faults:
        if f.kind != "slow_link" or last < 2:  # pp 2: the wrap is the adjacent link
            continue
        ia, ib = (np.unravel_index(r, ranks.shape) for r in sorted(f.ranks))
        if (ia[0], ib[0]) == (0, last) and ia[1:] == ib[1:]:
            link[ia[1:]] *= f.factor
    return bw, link


def _compute_factors(cfg: SynthConfig, ranks: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Each rank's lasting speed: a small healthy spread, times slow_rank, stage imbalance and
    its hardware class's time factor."""
    compute = (
        rng.lognormal(0.0, cfg.rank_spread, size=ranks.shape)
        if cfg.rank_spread
        else np.ones(ranks.shape)
    )
    flat = compute.reshape(-1)
    for f in cfg.faults:
        if f.kind == "slow_rank" and f.step <= 0:  # from a later step on: durations.py
            flat[f.rank] *= f.factor
    for stage, factor in cfg.extras.imbalance:
        compute[stage] *= factor
    for c in cfg.hw_classes:  # --hw-classes: each class's ranks at its time factor
        flat[c.first : c.last + 1] *= c.speed
    return compute


def build_cluster(cfg: SynthConfig, rng: np.random.Generator) -> Cluster:
    """Lay the mesh out as per-stage arrays and fold the lasting faults into them."""
    m = cfg.mesh
    shape = (m["dp"], m["cp"], m["tp"])
    ranks = np.arange(cfg.world_size, dtype=np.int64).reshape(m["pp"], *shape)
    for probe in (0, cfg.world_size - 1):  # the layout must agree with the SPEC's rank order
        c = coords_of(probe, m)
        assert ranks[c["pp"], c["dp"], c["cp"], c["tp"]] == probe
    bandwidth, link = {}, {}
    for axis in ("dp", "cp", "tp"):
        bandwidth[axis], link[axis] = _group_arrays(cfg, ranks, axis)
    p2p_bw, p2p_link = _p2p_arrays(cfg, ranks)
    wrap_bw, wrap_link = _wrap_arrays(cfg, ranks)
    return Cluster(
        pp=m["pp"],
        shape=shape,
        ranks=ranks,
        compute=_compute_factors(cfg, ranks, rng),
        bandwidth=bandwidth,
        link=link,
        p2p_bandwidth=p2p_bw,
        p2p_link=p2p_link,
        wrap_bandwidth=wrap_bw,
        wrap_link=wrap_link,
    )
