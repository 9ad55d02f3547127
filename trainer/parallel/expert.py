"""Expert parallelism: the experts of every MoE layer sharded over an ``ep`` group.

The ``ep`` group is a run of ``ep`` consecutive data-parallel ranks (``trainer/parallel/mesh.py``);
its member at position ``j`` holds experts ``[j * E / ep, (j + 1) * E / ep)`` of every layer.
Everything else (attention, norms, the router) stays replicated over the data-parallel group.

Dispatch and combine (:class:`ExpertDispatcher`). A layer's token assignments arrive sorted by
global expert id, so the rows for each ep rank are contiguous:

1. the per-expert counts (E,) go through a small ``all_to_all_single``: each rank learns how
   many rows every peer sends to each of its experts; both count vectors are read on the host
   once (the split sizes of the next exchanges need them, and so do the work records);
2. the rows go through ``torch.distributed.nn.functional.all_to_all_single`` (autograd-aware:
   its backward is the reverse exchange) with uneven split sizes; what arrives is grouped by
   source rank, then by expert, and is regrouped by expert (a stable sort) for the experts;
3. the outputs go back in the original order through the reverse exchange.

Gradients. Expert parameters differ between the members of an ep group and are replicated
over the ``edp`` group (the dp ranks at the same position of every run): their gradient is
reduced over ``edp`` only (``trainer/parallel/data_parallel.py``), divided by the whole dp
size, since each holder already summed the gradients of its whole ep group's tokens.

Tensor parallelism. The experts are not split over the TP group: every TP rank holds its ep
rank's experts whole and routes the same tokens (or, under sequence parallelism, its slice of
the sequence; the expert gradients are then summed over TP like the other replicated
parameters'). The expert compute is repeated on each TP rank: simple and correct, not fast.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn

from trainer.moe import MoE
from trainer.parallel.mesh import Mesh


def is_expert_param(name: str) -> bool:
    """Whether a parameter (named as in the plain GPT) belongs to an expert."""
    return ".mlp.experts." in name


class ExpertDispatcher:
    """Exchange one layer's sorted token rows with the ep group (module docstring)."""

    def __init__(self, group: dist.ProcessGroup, ep: int, n_experts: int) -> None:
        self.group, self.ep = group, ep
        self.local = n_experts // ep  # experts per rank

    def __call__(
        self,
        xs: torch.Tensor,
        counts: torch.Tensor,
        run_experts: Callable[[torch.Tensor, list[int]], torch.Tensor],
    ) -> tuple[torch.Tensor, list[int]]:
        """``xs`` (n, C) the rows sorted by global expert, ``counts`` (E,) rows per expert;
        ``run_experts(rows, per_local_expert_counts)`` the local experts. Returns the outputs
        (n, C) in the order of ``xs`` and the rows each local expert received."""
        ep, L = self.ep, self.local
        recv = torch.empty_like(counts)  # (E,) = (ep, L): what each peer sends my experts
        dist.all_to_all_single(recv, counts, group=self.group)
        host = torch.cat([counts, recv]).tolist()  # the one host sync
        sent, got = host[: ep * L], host[ep * L :]
        send_splits = [sum(sent[r * L : (r + 1) * L]) for r in range(ep)]
        recv_splits = [sum(got[r * L : (r + 1) * L]) for r in range(ep)]
        per_expert = [sum(got[r * L + j] for r in range(ep)) for j in range(L)]
        rows = dist_nn.all_to_all_single(
            xs.new_empty(sum(recv_splits), xs.size(1)),
            xs.contiguous(),
            output_split_sizes=recv_splits,
            input_split_sizes=send_splits,
            group=self.group,
        )  # (m, C): by source rank, then by local expert
        expert_of = torch.repeat_interleave(
            torch.arange(L, device=xs.device).repeat(ep), recv, output_size=rows.size(0)
        )  # (m,)
        by_expert = torch.argsort(expert_of, stable=True)
        ys = run_experts(rows[by_expert], per_expert)[torch.argsort(by_expert)]  # (m, C)
        out = dist_nn.all_to_all_single(
            xs.new_empty(xs.shape),
            ys.contiguous(),
            output_split_sizes=send_splits,
            input_split_sizes=recv_splits,
            group=self.group,
        )  # (n, C) in the order of xs
        return out, per_expert


def shard_experts(blocks: nn.ModuleDict, mesh: Mesh) -> None:
    """Keep this rank's experts in every MoE layer of ``blocks`` and install the dispatcher
    (nothing when ``ep == 1``)."""
    ep = mesh.size("ep")
    if ep == 1:
        return
    j = mesh.index("ep")
    for block in blocks.values():
        moe = block.mlp
        if not isinstance(moe, MoE):
            continue
        L = moe.n_experts // ep
        moe.experts = nn.ModuleDict(
            {str(e): moe.experts[str(e)] for e in range(j * L, (j + 1) * L)}
        )
        group = mesh.groups["ep"]
        assert group is not None  # ep > 1: the process group exists
        moe.dispatcher = ExpertDispatcher(group, ep, moe.n_experts)


def gather_experts(params: dict[str, torch.Tensor], mesh: Mesh) -> dict[str, torch.Tensor]:
    """``params`` (this rank's, plain names) with the other ep ranks' experts added."""
    if mesh.size("ep") == 1:
        return params
    mine = {k: v for k, v in params.items() if is_expert_param(k)}
    parts: list[dict[str, torch.Tensor] | None] = [None] * mesh.size("ep")
    dist.all_gather_object(parts, mine, group=mesh.groups["ep"])
    merged = dict(params)
    for part in parts:
        merged.update(part or {})
    return merged
