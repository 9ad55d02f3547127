"""A script's DeviceMesh as megascope's mesh: sizes, coordinates and group names, on meshes
too large to start here (torchtitan's pp x dp_replicate x dp_shard x cp x tp)."""

from __future__ import annotations

import itertools

from tracer.meshinfo import group_name, mesh_axes, mesh_coords
from tracer.rundir import coords_of

TITAN = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def test_torchtitan_mesh_follows_the_spec_rank_order():
    shape = (2, 2, 3, 2, 4)  # 96 ranks, torchtitan's dimension order
    sizes = mesh_axes(TITAN, shape)
    assert sizes == {"dp": 6, "pp": 2, "tp": 4, "cp": 2}
    for rank, index in enumerate(itertools.product(*(range(n) for n in shape))):
        # the mesh tensor of init_device_mesh is arange(world).view(shape)
        assert mesh_coords(TITAN, index, shape) == coords_of(rank, sizes), (rank, index)


def test_a_mesh_in_another_order_keeps_its_own_coordinates():
    names, shape = ("tp", "dp"), (2, 4)  # tensor parallel outermost: not the spec's order
    assert mesh_axes(names, shape) == {"dp": 4, "pp": 1, "tp": 2, "cp": 1}
    assert mesh_coords(names, (1, 3), shape) == {"dp": 3, "pp": 0, "tp": 1, "cp": 0}


def test_group_names_from_descriptions():
    assert group_name("mesh_tp") == "tp"
    assert group_name("mesh_dp_shard_cp") == "dp_shard_cp"  # a flattened dimension
    assert group_name("EXPERT_MODEL_PARALLEL_GROUP") == "EXPERT_MODEL_PARALLEL_GROUP"
    assert group_name("mesh_default") == "mesh_default"  # a world-sized copy of the default
    assert [group_name(d) for d in ("", "undefined", "default_pg")] == [None, None, None]
