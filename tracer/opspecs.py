"""What the collective wrappers need to know about each torch.distributed function.

For every function: the SPEC's op name (``all_gather_single`` is an ``all_gather``), where its
``group`` and ``async_op`` arguments sit, whether it is point-to-point, and how many bytes it
moves, by nccl-tests' conventions: the full array for all_gather, reduce_scatter, gather and
scatter (``n`` times the per-rank chunk), the summed input lists for ``all_to_all``, the tensor
for the rest. For the two all-to-alls also the bytes sent to each member of the group (the
``a2a_sent`` work rows), read from the arguments alone: split sizes are host lists, so no
tensor's values are read and the device is never synchronized. Checked against the signatures
of torch 2.13.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Getter = Callable[[str, int], Any]
SizeFn = Callable[[Getter, int], tuple[int, Any]]
PeerFn = Callable[[Getter, int], "list[int] | None"]


def tensor_nbytes(t: Any) -> int:
    """Bytes of a tensor (0 for None)."""
    return int(t.nbytes) if t is not None else 0


@dataclass(frozen=True)
class OneTensor:
    """The size of a call that takes one tensor: argument ``name`` (position ``idx``), its
    bytes times the group's size where ``times_group`` (gather, scatter). The collective
    wrappers' fast path reads these fields itself instead of calling it."""

    name: str
    idx: int
    times_group: bool = False

    def __call__(self, get: Getter, n: int) -> tuple[int, Any]:
        """(bytes, the tensor) of one call; ``get(name, idx)`` reads an argument and ``n`` is the
        group's size."""
        t = get(self.name, self.idx)
        return tensor_nbytes(t) * (n if self.times_group else 1), t


def _one(name: str, idx: int, times_group: bool = False) -> OneTensor:
    return OneTensor(name, idx, times_group)


def _many(name: str, idx: int) -> SizeFn:
    def size(get: Getter, n: int) -> tuple[int, Any]:
        ts = get(name, idx) or []
        return sum(tensor_nbytes(t) for t in ts), (ts[0] if ts else None)

    return size


def _none(get: Getter, n: int) -> tuple[int, Any]:
    return 0, None


def _a2a_single_sent(get: Getter, n: int) -> list[int] | None:
    """Bytes ``all_to_all_single`` sends to each group rank: ``input_split_sizes[i]`` rows of
    ``input`` (a row being ``input.shape[1:]``), or an even split of dim 0 when none are given.
    None when the sizes are not plain host integers (never read a tensor's values)."""
    t = get("input", 1)
    if t is None or t.dim() == 0 or n <= 0:
        return None
    row = math.prod(t.shape[1:]) * t.element_size()
    splits = get("input_split_sizes", 3)
    if splits is None or (isinstance(splits, (list, tuple)) and len(splits) == 0):
        return [t.shape[0] // n * row] * n
    if not isinstance(splits, (list, tuple)) or len(splits) != n:
        return None
    if not all(isinstance(s, int) for s in splits):
        return None
    return [s * row for s in splits]


def _a2a_list_sent(get: Getter, n: int) -> list[int] | None:
    """Bytes ``all_to_all`` sends to each group rank: each input tensor's."""
    ts = get("input_tensor_list", 1)
    if not isinstance(ts, (list, tuple)) or len(ts) != n:
        return None
    return [tensor_nbytes(t) for t in ts]


@dataclass(frozen=True)
class OpSpec:
    """How to read one torch.distributed function's calls (the module docstring): its op, where its
    group, ``async_op`` and peer arguments sit, and its bytes."""

    op: str
    group_idx: int
    size: SizeFn
    async_idx: int = -1  # -1: no async_op argument
    always_async: bool = False
    p2p: str | None = None  # the peer argument: "dst" or "src"
    peer_idx: int = 1
    sent: PeerFn | None = None  # bytes sent to each group rank (all-to-alls only)


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
    "all_to_all": OpSpec("all_to_all", 2, _many("input_tensor_list", 1), 3, sent=_a2a_list_sent),
    "all_to_all_single": OpSpec("all_to_all", 4, _one("input", 1), 5, sent=_a2a_single_sent),
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


# Bytes per element, by the dtype names that the profiler and Flight Recorder print.
_DTYPE_BYTES = {
    "float": 4, "float32": 4, "f32": 4, "int": 4, "int32": 4, "uint32": 4, "i32": 4,
    "double": 8, "float64": 8, "long": 8, "int64": 8, "uint64": 8, "f64": 8, "i64": 8,
    "half": 2, "float16": 2, "bfloat16": 2, "short": 2, "int16": 2, "f16": 2, "bf16": 2,
    "byte": 1, "char": 1, "bool": 1, "int8": 1, "uint8": 1, "signed char": 1,
    "unsigned char": 1, "int8_t": 1, "uint8_t": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "complexfloat": 8, "complexdouble": 16,
}  # fmt: skip

# Normalized op spellings (lowercase, underscores and affixes removed) -> SPEC op names.
_OPS = {
    "allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
    "broadcast": "broadcast", "alltoall": "all_to_all", "alltoallv": "all_to_all",
    "send": "send", "recv": "recv", "barrier": "barrier", "reduce": "reduce",
    "gather": "gather", "scatter": "scatter", "monitoredbarrier": "barrier",
}  # fmt: skip
_OP_AFFIXES = re.compile(r"(base|coalesced|intotensor|tensor|single)")


def normalize_op(name: str) -> str | None:
    """The SPEC op name for a collective as Kineto, NCCL or Flight Recorder spell it.

    ``nccl:_all_gather_base`` -> ``all_gather``, ``c10d::allreduce_`` -> ``all_reduce``,
    ``nccl:send 9->1`` -> ``send``, ``AllReduce`` -> ``all_reduce``. ``None`` when the name is
    not a collective (so callers can skip it).
    """
    text = name.strip().lower()
    for prefix in ("nccl:", "gloo:", "c10d::", "ucc:", "mpi:"):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    text = text.split(" ")[0]
    key = _OP_AFFIXES.sub("", text.replace("_", ""))
    return _OPS.get(key)


def dtype_bytes(dtype: str | None) -> int:
    """Bytes per element of a dtype name (0 when unknown)."""
    if not dtype:
        return 0
    key = str(dtype).strip().lower()
    for prefix in ("torch.", "c10::", "nccl"):
        if key.startswith(prefix):
            key = key[len(prefix) :]
    return _DTYPE_BYTES.get(key, 0)


def numel(shape: Any) -> int:
    """Elements of a shape such as ``[2048, 1, 5120]`` (0 for anything that is not a shape)."""
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) for d in shape):
        return 0
    n = 1
    for d in shape:
        n *= d
    return n
