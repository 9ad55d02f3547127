"""Process groups of an imported job: their labels in the collectives table, and the mesh.

Both Kineto (``distributedInfo.pg_config``, ``Process Group *`` args) and Flight Recorder
(``pg_config``, each entry's ``process_group``) name process groups by a *name* (a number
that is the same on every member) and a *description* (``TENSOR_MODEL_PARALLEL_GROUP`` in
Megatron, ``mesh_tp`` from a DeviceMesh, ``default_pg``, or whatever the user passed).

The mesh is derived from the descriptions: one group per axis whose description says tensor,
pipeline, data or context parallel gives that axis's size; the sizes must multiply to the world
size and every such group must be exactly the group of the SPEC's rank order (pipeline
outermost, tensor innermost) that holds its members, or no mesh is claimed (then the mesh is
``dp = world``, a flat data-parallel view, and every group keeps its description).

A group's *label* (the ``group`` column) is the axis name (``tp``...) for a group that is a
mesh axis, else its description; a label is made unique per rank by appending ``#name`` when
a rank belongs to two different groups with the same description. With the label and the
rank, ``run.json``'s ``groups`` list (``{name, ranks, pg_name, desc}``) finds the instance.
"""

from __future__ import annotations

import ast
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tracer.rundir import AXES, mesh_groups

log = logging.getLogger(__name__)

# Descriptions (upper case) that name one mesh axis, as Megatron, DeviceMesh and users write them.
_AXIS_DESCS = {
    "tp": ("TENSOR_MODEL_PARALLEL_GROUP", "MESH_TP", "TP", "TENSOR_PARALLEL"),
    "pp": ("PIPELINE_MODEL_PARALLEL_GROUP", "MESH_PP", "PP", "PIPELINE_PARALLEL"),
    "dp": ("DATA_PARALLEL_GROUP", "DATA_PARALLEL_GROUP_WITH_CP", "MESH_DP", "DP", "DATA_PARALLEL"),
    "cp": ("CONTEXT_PARALLEL_GROUP", "MESH_CP", "CP", "CONTEXT_PARALLEL"),
}


@dataclass(frozen=True)
class Group:
    """One process group: ``name`` is the same on all members, ``ranks`` sorted (may be
    empty when the source did not record them)."""

    name: str
    desc: str
    ranks: tuple[int, ...]


def parse_ranks(value: object) -> tuple[int, ...]:
    """Ranks as Kineto and Flight Recorder store them: a list, or a string such as
    ``"[0, 1, 2]"`` (a literal, never evaluated as code). Unparseable or truncated -> ()."""
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value.strip() or "[]")
        except (ValueError, SyntaxError):
            return ()
    if isinstance(value, (list, tuple)) and all(isinstance(r, int) for r in value):
        return tuple(sorted(value))
    return ()


def axis_of(desc: str) -> str | None:
    """The mesh axis a description names, if any."""
    key = desc.strip().upper()
    for axis, names in _AXIS_DESCS.items():
        if key in names:
            return axis
    return None


def derive_mesh(groups: Iterable[Group], world_size: int) -> dict[str, int] | None:
    """The (dp, pp, tp, cp) mesh the axis groups describe, or ``None`` when they do not
    describe one consistently (see the module docstring)."""
    by_axis: dict[str, list[Group]] = {a: [] for a in AXES}
    for g in groups:
        axis = axis_of(g.desc)
        if axis and g.ranks:
            by_axis[axis].append(g)
    if not any(by_axis.values()):
        return None
    exact_dp = [g for g in by_axis["dp"] if not g.desc.upper().endswith("_WITH_CP")]
    by_axis["dp"] = exact_dp or by_axis["dp"]
    sizes = {a: (len(gs[0].ranks) if gs else 1) for a, gs in by_axis.items()}
    if not by_axis["dp"]:
        rest = sizes["pp"] * sizes["tp"] * sizes["cp"]
        sizes["dp"] = world_size // rest if rest and world_size % rest == 0 else 0
    if sizes["dp"] * sizes["pp"] * sizes["tp"] * sizes["cp"] != world_size:
        return None
    expected = {(g["name"], tuple(g["ranks"])) for g in mesh_groups(sizes)}
    for axis, gs in by_axis.items():
        for g in gs:
            if len(g.ranks) > 1 and (axis, g.ranks) not in expected:
                log.info("group %s (%s) is not a %s group of mesh %s", g.name, g.desc, axis, sizes)
                return None
    return sizes


def label_groups(groups: Iterable[Group], mesh: Mapping[str, int] | None) -> dict[str, str]:
    """``{group name: label}`` as the module docstring defines it."""
    groups = list(groups)
    expected: set[tuple[str, tuple[int, ...]]] = set()
    if mesh:
        expected = {(g["name"], tuple(g["ranks"])) for g in mesh_groups(mesh)}
    labels: dict[str, str] = {}
    for g in groups:
        axis = axis_of(g.desc)
        if axis and (axis, g.ranks) in expected:
            labels[g.name] = axis
        else:
            labels[g.name] = g.desc or g.name or "unknown"
    # Two different groups with one label on a common member would be confused: disambiguate.
    seen: dict[tuple[int, str], str] = {}
    clash: set[str] = set()
    for g in groups:
        for r in g.ranks:
            other = seen.setdefault((r, labels[g.name]), g.name)
            if other != g.name:
                clash.update((other, g.name))
    for name in clash:
        labels[name] = f"{labels[name]}#{name}"
    return labels


def run_json_groups(groups: Iterable[Group], labels: Mapping[str, str]) -> list[dict]:
    """run.json's ``groups``: every group with members, as ``{name, ranks, pg_name, desc}``."""
    out = []
    for g in sorted(groups, key=lambda g: (labels.get(g.name, g.name), g.ranks)):
        if g.ranks:
            out.append(
                {"name": labels.get(g.name, g.name), "ranks": list(g.ranks), "pg_name": g.name,
                 "desc": g.desc}
            )  # fmt: skip
    return out


def fallback_mesh(world_size: int) -> dict[str, int]:
    """The mesh claimed when the groups do not describe one: every rank a data-parallel peer."""
    return {"dp": max(world_size, 1), "pp": 1, "tp": 1, "cp": 1}


def complete_groups(
    groups: Mapping[str, Group], unlisted: set[str], present: set[int], world: int
) -> tuple[dict[str, Group], int]:
    """Groups whose members were read off their users (no recorded membership), completed
    with the ranks that left no trace: each axis group (by its description) becomes the group
    of the mesh that the axis groups describe, when it lacks only ranks that are not in
    ``present``. Returns the groups and the world size (the mesh's, when it is larger)."""
    out = dict(groups)
    by_axis: dict[str, list[Group]] = {a: [] for a in AXES}
    for name in unlisted:
        g = groups[name]
        axis = axis_of(g.desc)
        if axis and g.ranks:
            by_axis[axis].append(g)
    if not any(by_axis.values()):
        return out, world
    sizes = {a: max((len(g.ranks) for g in gs), default=1) for a, gs in by_axis.items()}
    if not by_axis["dp"]:
        rest = sizes["pp"] * sizes["tp"] * sizes["cp"]
        if world % rest:
            return out, world
        sizes["dp"] = world // rest
    size = sizes["dp"] * sizes["pp"] * sizes["tp"] * sizes["cp"]
    if size < world:
        return out, world
    expected: dict[tuple[str, int], tuple[int, ...]] = {}
    for mg in mesh_groups(sizes):
        for r in mg["ranks"]:
            expected[(mg["name"], r)] = tuple(mg["ranks"])
    for axis, gs in by_axis.items():
        for g in gs:
            full = expected.get((axis, g.ranks[0]))
            if full is None or not set(g.ranks) <= set(full):
                continue
            lacking = set(full) - set(g.ranks)
            if lacking and not lacking & present:
                out[g.name] = Group(g.name, g.desc, full)
    return out, size
