"""What the collective wrappers need to know about each torch.distributed function.

For every function: the SPEC's op name (``all_gather_single`` is an ``all_gather``), where its
``group`` and ``async_op`` arguments sit, whether it is point-to-point, and how many bytes it
moves, by nccl-tests' conventions: the full array for all_gather, reduce_scatter, gather and
scatter (``n`` times the per-rank chunk), the summed input lists for ``all_to_all``, the tensor
for the rest. Checked against the signatures of torch 2.13.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Getter = Callable[[str, int], Any]
SizeFn = Callable[[Getter, int], tuple[int, Any]]


def tensor_nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size()) if t is not None else 0


def _one(name: str, idx: int, times_group: bool = False) -> SizeFn:
    def size(get: Getter, n: int) -> tuple[int, Any]:
        t = get(name, idx)
        return tensor_nbytes(t) * (n if times_group else 1), t

    return size


def _many(name: str, idx: int) -> SizeFn:
    def size(get: Getter, n: int) -> tuple[int, Any]:
        ts = get(name, idx) or []
        return sum(tensor_nbytes(t) for t in ts), (ts[0] if ts else None)

    return size


def _none(get: Getter, n: int) -> tuple[int, Any]:
    return 0, None


@dataclass(frozen=True)
class OpSpec:
    op: str
    group_idx: int
    size: SizeFn
    async_idx: int = -1  # -1: no async_op argument
    always_async: bool = False
    p2p: str | None = None  # the peer argument: "dst" or "src"
    peer_idx: int = 1


_GATHER_T = _one("output_tensor", 0)
_SCATTER_T = _one("input", 1)

OP_SPECS: dict[str, OpSpec] = {
    "all_reduce": OpSpec("all_reduce", 2, _one("tensor", 0), 3),
    "all_gather": OpSpec("all_gather", 2, _many("tensor_list", 0), 3),
    "all_gather_into_tensor": OpSpec("all_gather", 2, _GATHER_T, 3),
    "all_gather_single": OpSpec("all_gather", 2, _GATHER_T, 3),
    "_all_gather_base": OpSpec("all_gather", 2, _one("output_tensor", 0), 3),
    "reduce_scatter": OpSpec("reduce_scatter", 3, _many("input_list", 1), 4),
    "reduce_scatter_tensor": OpSpec("reduce_scatter", 3, _SCATTER_T, 4),
    "reduce_scatter_single": OpSpec("reduce_scatter", 3, _SCATTER_T, 4),
    "_reduce_scatter_base": OpSpec("reduce_scatter", 3, _one("input", 1), 4),
    "all_to_all": OpSpec("all_to_all", 2, _many("input_tensor_list", 1), 3),
    "all_to_all_single": OpSpec("all_to_all", 4, _one("input", 1), 5),
    "broadcast": OpSpec("broadcast", 2, _one("tensor", 0), 3),
    "reduce": OpSpec("reduce", 3, _one("tensor", 0), 4),
    "gather": OpSpec("gather", 3, _one("tensor", 0, times_group=True), 4),
    "scatter": OpSpec("scatter", 3, _one("tensor", 0, times_group=True), 4),
    "barrier": OpSpec("barrier", 0, _none, 1),
    "monitored_barrier": OpSpec("barrier", 0, _none),
    "send": OpSpec("send", 2, _one("tensor", 0), p2p="dst"),
    "recv": OpSpec("recv", 2, _one("tensor", 0), p2p="src"),
    "isend": OpSpec("send", 2, _one("tensor", 0), always_async=True, p2p="dst"),
    "irecv": OpSpec("recv", 2, _one("tensor", 0), always_async=True, p2p="src"),
}
