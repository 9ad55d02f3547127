"""The device mesh: this rank's coordinates and one process group per parallel axis.

Rank order follows the SPEC (pipeline outermost, tensor innermost):
``rank = ((pp * dp_size + dp) * cp_size + cp) * tp_size + tp``, computed by
``tracer.rundir.coords_of``. A tensor-parallel group is therefore consecutive ranks.

Groups are created with ``dist.new_group``, which every rank must call for every group in the
same order: axes in the order tp, cp, dp, pp, and within an axis by the group's lowest rank.
Each rank keeps the one group of each axis it belongs to. All state lives in the Mesh object
(no module-level process groups); pass it explicitly.

Expert parallelism adds two groups carved from each data-parallel group, created after the
four axes (:func:`expert_groups`): ``ep``, runs of ``ep`` consecutive dp indices (dp index
``d`` is in run ``d // ep`` at position ``d % ep``), over which the experts are sharded; and
``edp``, the dp ranks at the same position of every run, which hold the same experts and
reduce their gradients together. They exist only when ``ep > 1``; ``size``/``index`` answer
for them too (``ep`` and ``edp`` are not mesh axes: ``sizes`` and ``coords`` stay the four).

Without an initialised process group a Mesh can still be built for a world of one rank (the
one-process reference); its groups are then ``None`` and every collective helper in
``trainer.parallel`` skips groups of size one.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from tracer.rundir import RANK_ORDER, coords_of, rank_of
from trainer.config import ParallelConfig

log = logging.getLogger(__name__)

EXPERT_AXES = ("ep", "edp")


def axis_groups(sizes: dict[str, int], axis: str) -> list[list[int]]:
    """Every group of ``axis`` as a sorted list of global ranks, ordered by lowest rank."""
    world = sizes["dp"] * sizes["pp"] * sizes["tp"] * sizes["cp"]
    groups: dict[int, list[int]] = {}
    for r in range(world):
        c = coords_of(r, sizes)
        members = [rank_of({**c, axis: i}, sizes) for i in range(sizes[axis])]
        groups.setdefault(min(members), members)
    return [groups[k] for k in sorted(groups)]


def expert_groups(parallel: ParallelConfig) -> list[dict[str, Any]]:
    """Every ``ep`` group, then every ``edp`` group, as ``{"name", "ranks"}`` (global ranks
    in dp order), each axis ordered by lowest rank; none when ``ep == 1``."""
    ep = parallel.ep
    if ep == 1:
        return []
    dp_groups = axis_groups(parallel.sizes, "dp")
    runs = [d[start : start + ep] for d in dp_groups for start in range(0, parallel.dp, ep)]
    same_place = [d[j::ep] for d in dp_groups for j in range(ep)]
    return [
        {"name": name, "ranks": ranks}
        for name, groups in (("ep", runs), ("edp", same_place))
        for ranks in sorted(groups)
    ]


class Mesh:
    """This rank's place in the dp x pp x tp x cp mesh.

    Attributes: ``parallel`` (the config), ``sizes`` (``{"dp", "pp", "tp", "cp"}``),
    ``rank``, ``world_size``, ``coords`` (this rank's ``{"dp", "pp", "tp", "cp"}``),
    ``groups`` (``{"tp", "cp", "dp", "pp"}``, and ``"ep"``, ``"edp"`` when ``ep > 1`` ->
    ProcessGroup), ``group_ranks`` (axis -> the
    global ranks of this rank's group, in axis order).
    """

    def __init__(self, parallel: ParallelConfig) -> None:
        self.parallel = parallel
        self.sizes = parallel.sizes
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        else:
            self.rank, self.world_size = 0, 1
        if self.world_size != parallel.world_size:
            raise ValueError(
                f"the mesh dp={parallel.dp} pp={parallel.pp} tp={parallel.tp} cp={parallel.cp} "
                f"needs {parallel.world_size} ranks, the world has {self.world_size}"
            )
        self.coords = coords_of(self.rank, self.sizes)
        self.group_ranks: dict[str, list[int]] = {}
        self.groups: dict[str, dist.ProcessGroup | None] = {}
        for axis in RANK_ORDER:  # every rank makes the groups in the same order
            for members in axis_groups(self.sizes, axis):
                # named after its axis, so that Flight Recorder dumps say which group is which
                group = dist.new_group(members, group_desc=axis) if dist.is_initialized() else None
                if self.rank in members:
                    self.group_ranks[axis] = members
                    self.groups[axis] = group
        for g in expert_groups(parallel):
            axis, members = str(g["name"]), list(g["ranks"])
            group = dist.new_group(members, group_desc=axis) if dist.is_initialized() else None
            if self.rank in members:
                self.group_ranks[axis] = members
                self.groups[axis] = group
        log.debug("rank %d coords %s groups %s", self.rank, self.coords, self.group_ranks)

    # -- convenience -------------------------------------------------------------------------
    def size(self, axis: str) -> int:
        """The size of ``axis``: one of the four, or ``ep`` / ``edp`` (module docstring)."""
        if axis == "ep":
            return self.parallel.ep
        if axis == "edp":
            return self.sizes["dp"] // self.parallel.ep
        return self.sizes[axis]

    def index(self, axis: str) -> int:
        """This rank's coordinate along ``axis`` (``ep``: its place in its run of dp ranks,
        whose experts it holds; ``edp``: which run)."""
        if axis == "ep":
            return self.coords["dp"] % self.parallel.ep
        if axis == "edp":
            return self.coords["dp"] // self.parallel.ep
        return self.coords[axis]

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank is on the first pipeline stage."""
        return self.coords["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank is on the last pipeline stage."""
        return self.coords["pp"] == self.sizes["pp"] - 1

    def pp_peer(self, offset: int) -> int:
        """Global rank of the stage ``offset`` away in this rank's pipeline (+1 next, -1 previous)."""
        return self.group_ranks["pp"][self.coords["pp"] + offset]

    def describe(self) -> str:
        """``rank R (dpD ppP tpT cpC)``, for logs."""
        c = self.coords
        return f"rank {self.rank} (dp{c['dp']} pp{c['pp']} tp{c['tp']} cp{c['cp']})"
