"""NCCL completion hooks: collectives that bypass torch.distributed's Python API.

DDP's C++ reducer and FSDP issue NCCL collectives that no Python wrapper sees. ProcessGroupNCCL
can call a Python hook when each of its works completes (``_register_on_completion_hook``,
which needs ``TORCH_NCCL_ENABLE_TIMING=1`` set before the group is created). The hook receives
the op type, the group's sequence number, and the start and end times measured by NCCL's own
CUDA events. To avoid counting twice what the wrappers already recorded, the wrappers ``note``
the group's sequence number after each call they made; the hook skips those.

UNVERIFIED: written against torch's documented ``WorkInfo`` fields and never run here (the
project's test machines have no GPU). Every access is guarded; on any surprise the hooks turn
themselves off with one warning. gloo offers no such hook (it raises), so nothing is installed.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_OPS = {
    "ALLREDUCE": "all_reduce",
    "ALLGATHER": "all_gather",
    "_ALLGATHER_BASE": "all_gather",
    "ALLGATHER_COALESCED": "all_gather",
    "REDUCE_SCATTER": "reduce_scatter",
    "_REDUCE_SCATTER_BASE": "reduce_scatter",
    "REDUCE_SCATTER_TENSOR_COALESCED": "reduce_scatter",
    "ALLTOALL": "all_to_all",
    "ALLTOALL_BASE": "all_to_all",
    "BROADCAST": "broadcast",
    "REDUCE": "reduce",
    "GATHER": "gather",
    "SCATTER": "scatter",
    "BARRIER": "barrier",
    "SEND": "send",
    "RECV": "recv",
}


class CompletionHooks:
    """Records the NCCL works the Python wrappers did not issue into the collectives buffer."""

    def __init__(self, add_row: Callable[[tuple], None], step: Callable[[], int]) -> None:
        self._add = add_row
        self._step = step
        self._seen: dict[Any, set[int]] = {}
        self._lock = threading.Lock()
        self.active = True

    @staticmethod
    def available() -> bool:
        return os.environ.get("TORCH_NCCL_ENABLE_TIMING", "0") not in ("", "0")

    def install(self, pg: Any, name: str) -> bool:
        """Register the hook on an NCCL group; False when this group cannot have one."""
        try:
            backend = pg._get_backend_name() if hasattr(pg, "_get_backend_name") else ""
            if "nccl" not in str(backend).lower():
                return False
            size = pg.size()
            pg._register_on_completion_hook(lambda info: self._hook(info, pg, name, size))
            return True
        except Exception as exc:
            log.debug("no NCCL completion hook on group %s: %s", name, exc)
            return False

    def note(self, pg: Any) -> None:
        """Called by a wrapper right after it issued a collective on ``pg``."""
        if not self.active:
            return
        try:
            seq = int(pg._get_sequence_number_for_group())
        except Exception:
            return
        with self._lock:
            self._seen.setdefault(pg, set()).add(seq)

    def _hook(self, info: Any, pg: Any, name: str, size: int) -> None:
        if not self.active:
            return
        try:
            seq = int(info.seq)
            with self._lock:
                seen = self._seen.get(pg)
                if seen is not None and seq in seen:
                    seen.discard(seq)
                    return
            op = _OPS.get(str(info.op_type).rsplit(".", 1)[-1], str(info.op_type).lower())
            start = int(info.time_started.timestamp() * 1e9)
            end = int(info.time_finished.timestamp() * 1e9)
            # step, microbatch, op, group, size, seq, peer, nbytes, dtype, issue, start, end, source
            self._add(
                (self._step(), -1, op, name, size, seq, -1, -1, "", start, start, end, "cuda")
            )
        except Exception as exc:
            self.active = False
            log.warning("megascope: NCCL completion hook disabled: %s", exc)
