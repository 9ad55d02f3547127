"""A rank's own accounting of the memory its training state holds, by what it is for.

Counted from the engine's tensors, not estimated: the flat parameter and gradient buckets of
``parallel.data_parallel`` (whole on every DP rank), and the optimizer's share (the master
slice, the reduced gradient slice when it is a buffer of its own, and every tensor of the
optimizer's state: AdamW's or LAMB's moments, wherever they live). Tensors are counted once
by storage. Activations are not counted (they come and go within a step); on a GPU the
allocator's peak (``torch.cuda.max_memory_allocated``) covers them. Each rank writes this
after its first step (``progress.write_memory``); the launcher puts every rank's into
run.json ``memory`` (docs/spec.md §2), which ``megascope plan`` checks its prediction against.
"""

from __future__ import annotations

from typing import Any

import torch


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nest of dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _bytes(tensors: list[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or t.numel() == 0:
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes()
    return total


def rank_memory(engine: Any) -> dict[str, int]:
    """Bytes of this rank's ``params``, ``grads`` and ``optimizer`` state (module docstring),
    and on CUDA the allocator's ``peak_allocated`` so far."""
    buckets = engine.dp.buckets
    seen: set[int] = set()
    params = _bytes([b.param_buf for b in buckets], seen)
    grads = _bytes([b.grad_buf for b in buckets], seen)
    state = _tensors(engine.optimizer.state_dict())
    optimizer = _bytes([b.master for b in buckets] + [b.shard_grad for b in buckets] + state, seen)
    out = {"params_bytes": params, "grads_bytes": grads, "optimizer_bytes": optimizer}
    if engine.device.type == "cuda":
        out["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated(engine.device))
    return out
