"""The importers' shared pieces: op names, sizes, ranks from file names, groups and mesh."""

from __future__ import annotations

import pytest

from analyzer.importers.common import dtype_bytes, normalize_op, rank_from_filename
from analyzer.importers.groups import Group, derive_mesh, label_groups, parse_ranks


@pytest.mark.parametrize(
    "name, op",
    [
        ("nccl:all_reduce", "all_reduce"),
        ("c10d::allreduce_", "all_reduce"),
        ("allreduce_coalesced", "all_reduce"),
        ("nccl:_all_gather_base", "all_gather"),
        ("_allgather_base", "all_gather"),
        ("all_gather_into_tensor_coalesced", "all_gather"),
        ("nccl:_reduce_scatter_base", "reduce_scatter"),
        ("reduce_scatter_tensor", "reduce_scatter"),
        ("gloo:broadcast", "broadcast"),
        ("nccl:all_to_all", "all_to_all"),
        ("c10d::alltoall_base_", "all_to_all"),
        ("all_to_allv", "all_to_all"),
        ("nccl:send 9->1", "send"),
        ("nccl:recv 1<-0", "recv"),
        ("gloo:barrier", "barrier"),
        ("AllReduce", "all_reduce"),
        ("ReduceScatter", "reduce_scatter"),
        ("aten::mm", None),
        ("SendRecv", None),
    ],
)
def test_normalize_op(name, op):
    assert normalize_op(name) == op


def test_sizes_and_file_ranks():
    assert [dtype_bytes(d) for d in ("BFloat16", "Float", "Long", "Byte", "c10::Half", "?")] == [
        2, 4, 8, 1, 2, 0,
    ]  # fmt: skip
    assert rank_from_filename("x/_dump_9") == 9
    assert rank_from_filename("sampled_rank-1.json.gz") == 1
    assert rank_from_filename("host_3.12345.pt.trace.json") == 12345
    assert rank_from_filename("trace.json") is None
    assert parse_ranks("[3, 1, 2]") == (1, 2, 3)
    assert parse_ranks("[0, 1, ...]") == () and parse_ranks("__import__('os')") == ()


def _megatron(tp: int, pp: int, dp: int) -> list[Group]:
    world = tp * pp * dp
    out, n = [], 1
    for start in range(0, world, tp):
        out.append(Group(str(n), "TENSOR_MODEL_PARALLEL_GROUP", tuple(range(start, start + tp))))
        n += 1
    for r in range(dp * tp):
        out.append(Group(str(n), "PIPELINE_MODEL_PARALLEL_GROUP", tuple(range(r, world, dp * tp))))
        n += 1
    for p in range(pp):
        for t in range(tp):
            base = p * dp * tp + t
            out.append(Group(str(n), "DATA_PARALLEL_GROUP", tuple(range(base, base + dp * tp, tp))))
            n += 1
    return out


def test_mesh_from_megatron_descriptions():
    groups = _megatron(tp=2, pp=2, dp=3)
    mesh = derive_mesh(groups, 12)
    assert mesh == {"dp": 3, "pp": 2, "tp": 2, "cp": 1}
    labels = label_groups(groups, mesh)
    assert {labels[g.name] for g in groups} == {"tp", "pp", "dp"}


def test_mesh_from_device_mesh_names_and_inconsistent_groups():
    groups = [Group("1", "mesh_tp", (0, 1)), Group("2", "mesh_tp", (2, 3)),
              Group("3", "mesh_dp", (0, 2)), Group("4", "mesh_dp", (1, 3))]  # fmt: skip
    assert derive_mesh(groups, 4) == {"dp": 2, "pp": 1, "tp": 2, "cp": 1}
    # a "tp" group of strided ranks is not the SPEC's tensor group: no mesh is claimed
    wrong = [Group("1", "tp", (0, 2)), Group("2", "tp", (1, 3))]
    assert derive_mesh(wrong, 4) is None
    assert label_groups(wrong, None) == {"1": "tp", "2": "tp"}


def test_labels_made_unique_where_a_rank_has_two_groups_of_one_description():
    groups = [Group("5", "undefined", (0, 1)), Group("6", "undefined", (0, 1)),
              Group("7", "undefined", (2, 3))]  # fmt: skip
    labels = label_groups(groups, None)
    assert labels == {"5": "undefined#5", "6": "undefined#6", "7": "undefined"}
