"""Memory per rank of a layout: parameters, gradients, optimizer states, activations.

The trainer's own accounting (``trainer/parallel/data_parallel.py``, reported per rank in
run.json ``memory``) is what the first three follow, per rank of a stage holding ``P``
parameters (its tensor-parallel shard):

* parameters: ``4 P`` (the flat float32 buckets; bf16 runs autocast, they keep fp32 weights);
* gradients: ``4 P`` (the flat float32 gradient buckets, kept whole);
* optimizer: with the optimizer sharded over ``dp``, ``(4 + 8) P / dp`` (the float32 master
  slice and AdamW's or LAMB's two moments) plus ``4 P / dp`` for the reduced gradient slice
  when ``dp > 1``; unsharded, ``12 P``.

A simulated run is priced as Megatron's mixed precision: bf16 parameters (``2 P``), fp32
gradients, the same optimizer. Activations are an estimate (:meth:`Shape.activation_bytes`),
not checked against any accounting on a CPU: the trainer has none for them.

A rank's peak is the largest stage's; a layout fits when it is under the device's memory
(``--device-memory``, by default the run's device: its known capacity by name, or on a CPU
this host's physical memory shared by the run's ranks).
"""

from __future__ import annotations

import os
import re
from typing import Any

from analyzer.plan.shape import PlanError, Shape

GIB = 2**30

# Memory of a device by name (the first part found in the name wins).
DEVICE_MEMORY: list[tuple[str, float]] = [
    ("H200", 141e9),
    ("GH200", 96 * GIB),
    ("H100", 80 * GIB),
    ("B200", 180e9),
    ("A100-SXM4-40GB", 40 * GIB),
    ("A100", 80 * GIB),
    ("L40S", 48 * GIB),
    ("A10G", 24 * GIB),
    ("L4", 24 * GIB),
]

_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
          "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(text: str) -> float:
    """``80GiB``, ``24G``, ``512MiB``, ``1e9``: bytes, or :class:`PlanError`."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text or "")
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise PlanError(f"--device-memory {text!r}: expected a size such as 80GiB, 24G or 512MiB")
    return float(m.group(1)) * _UNITS[unit]


def run_device_memory(meta: dict[str, Any]) -> tuple[float | None, str]:
    """The memory of one of the run's devices, and where the number comes from."""
    name = str(meta.get("device_name") or "")
    if meta.get("device") == "cpu":
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None, "unknown (a CPU run, this host's memory unreadable)"
        world = max(1, int(meta.get("world_size") or 1))
        return total / world, f"this host's {total / GIB:.1f} GiB shared by {world} CPU ranks"
    if (meta.get("tracer") or {}).get("simulated") and not name:
        name = "H100"  # the simulator's device
    for part, size in DEVICE_MEMORY:
        if part in name:
            return size, f"{name} ({size / GIB:.0f} GiB)"
    return None, f"unknown for device {name or meta.get('device') or '?'}: pass --device-memory"


def rank_memory(shape: Shape, dp: int, tp: int, pp: int, cp: int, recompute: str,
                sharded: bool) -> dict[str, float]:  # fmt: skip
    """Bytes per rank at the busiest stage: parameters, gradients, optimizer, activations,
    total (see the module docstring)."""
    best: dict[str, float] = {}
    for s in range(pp):
        p = shape.rank_params(pp, tp, s)
        params = p * (2 if shape.simulated else 4)
        grads = 4.0 * p
        if sharded:
            opt = 12.0 * p / dp + (4.0 * p / dp if dp > 1 else 0.0)
        else:
            opt = 12.0 * p
        act = shape.activation_bytes(pp, tp, cp, s, recompute)
        row = {"params_bytes": params, "grads_bytes": grads, "optimizer_bytes": opt,
               "activations_bytes": act, "total_bytes": params + grads + opt + act}  # fmt: skip
        if row["total_bytes"] > best.get("total_bytes", -1.0):
            best = row
    if not best:
        raise PlanError("a layout without stages")
    return best
