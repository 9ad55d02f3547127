"""Tensor and sequence parallelism: paired autograd functions and the layers built on them.

Four tiny autograd functions, each the mirror of another (as in Megatron core):

=========================  =========================  ==============================
function                   forward                    backward
=========================  =========================  ==============================
``copy_to_tp``             identity                   all-reduce over TP
``reduce_from_tp``         all-reduce over TP         identity
``gather_from_sp``         all-gather along sequence  reduce-scatter along sequence
``scatter_to_sp``          reduce-scatter along seq.  all-gather along sequence
=========================  =========================  ==============================

A column-parallel linear (output features split) enters the TP region with ``copy_to_tp``, or
with ``gather_from_sp`` under sequence parallelism; a row-parallel linear (input features
split) leaves it with ``reduce_from_tp`` or ``scatter_to_sp``. Outside the TP region, under SP,
activations are (B, T/tp, C): each rank holds a slice of the sequence. The sequence is dim 1
(batch first); the gathers move it to dim 0 for the flat ``*_single`` collectives.

Every collective is an attribute lookup on ``torch.distributed`` at call time, so wrappers
installed on that module (fault injection, the tracer) see each call. Groups of size one skip
their collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group`` (1 for None)."""
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, t, ...) on each rank -> (B, tp*t, ...), rank order along the sequence."""
    n = group_size(group)
    if n == 1:
        return x
    xt = x.transpose(0, 1).contiguous()  # (t, B, ...)
    out = xt.new_empty((n * xt.size(0), *xt.shape[1:]))
    dist.all_gather_single(out, xt, group=group)
    return out.transpose(0, 1)


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T, ...) partial sums on each rank -> (B, T/tp, ...) full sums of this rank's slice."""
    n = group_size(group)
    if n == 1:
        return x
    xt = x.transpose(0, 1).contiguous()  # (T, B, ...)
    out = xt.new_empty((xt.size(0) // n, *xt.shape[1:]))
    dist.reduce_scatter_single(out, xt, group=group)
    return out.transpose(0, 1)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_seq(g, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_seq(g, ctx.group), None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Enter the TP region: identity forward, all-reduce backward."""
    return _CopyToTP.apply(x, group) if group_size(group) > 1 else x


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Leave the TP region: all-reduce forward, identity backward."""
    return _ReduceFromTP.apply(x, group) if group_size(group) > 1 else x


def gather_from_sp(x: torch.Tensor, group) -> torch.Tensor:
    """Enter the TP region under SP: all-gather along the sequence forward, reduce-scatter
    backward."""
    return _GatherFromSP.apply(x, group) if group_size(group) > 1 else x


def scatter_to_sp(x: torch.Tensor, group) -> torch.Tensor:
    """Leave the TP region under SP: reduce-scatter along the sequence forward, all-gather
    backward."""
    return _ScatterToSP.apply(x, group) if group_size(group) > 1 else x


class ColumnParallelLinear(nn.Module):
    """``y_local = x @ W[rows]^T + b[rows]``: this rank's share of the output features.

    The input enters the TP region through ``copy_to_tp`` (its gradient is summed over the
    ranks in backward) or, under SP, through ``gather_from_sp`` (the sequence slices are
    gathered; the gradient is reduce-scattered back)."""

    def __init__(self, linear: nn.Linear, rows: torch.Tensor, group, sp: bool) -> None:
        super().__init__()
        self.group, self.sp = group, sp
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        b = linear.bias
        self.bias = None if b is None else nn.Parameter(b.detach()[rows].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output features (the input gathered along the sequence first
        under SP)."""
        x = gather_from_sp(x, self.group) if self.sp else copy_to_tp(x, self.group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = sum_ranks(x_local @ W[:, cols]^T) + b``: the partial products are all-reduced, or
    reduce-scattered along the sequence under SP; the (unsplit) bias is added afterwards."""

    def __init__(self, linear: nn.Linear, cols: torch.Tensor, group, sp: bool) -> None:
        super().__init__()
        self.group, self.sp = group, sp
        self.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())
        b = linear.bias
        self.bias = None if b is None else nn.Parameter(b.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The partial products of this rank's input features, all-reduced over the TP group
        (reduce-scattered along the sequence under SP), plus the bias."""
        y = F.linear(x, self.weight)
        y = scatter_to_sp(y, self.group) if self.sp else reduce_from_tp(y, self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + V/tp)`` of the embedding table. Tokens outside the range look
    up row 0 and are zeroed, so the ranks' outputs sum to the full lookup: all-reduced, or
    reduce-scattered along the sequence under SP (the output is then (B, T/tp, C))."""

    def __init__(self, embedding: nn.Embedding, rank: int, group, sp: bool) -> None:
        super().__init__()
        self.group, self.sp = group, sp
        n = embedding.num_embeddings // group_size(group)
        self.start = rank * n
        self.weight = nn.Parameter(embedding.weight.detach()[self.start : self.start + n].clone())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``idx``: this rank's rows, summed over the TP group (reduce-scattered
        along the sequence under SP)."""
        local = idx - self.start
        outside = (local < 0) | (local >= self.weight.size(0))
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, C), partial
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return scatter_to_sp(out, self.group) if self.sp else reduce_from_tp(out, self.group)


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy over logits split along the vocabulary, without gathering them.

    With ``m`` the global max, ``lse = m + log(sum_ranks sum_v exp(l_v - m))``; the target's
    logit lives on one rank and is summed with zeros from the others. Two all-reduces: the
    max, then the target logits and the exp-sums together. Backward: ``softmax - onehot(target)`` on the local columns."""

    @staticmethod
    def forward(ctx, logits, target, start, group):
        logits = logits.float()  # (N, V/tp)
        m = logits.max(dim=-1).values
        _all_reduce(m, group, op=dist.ReduceOp.MAX)
        shifted = logits - m.unsqueeze(-1)
        local = target - start
        inside = (local >= 0) & (local < logits.size(-1))
        local = local.masked_fill(~inside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside
        exp = shifted.exp()
        sums = torch.stack([picked, exp.sum(dim=-1)])  # one all-reduce for both: (2, N)
        _all_reduce(sums, group)
        picked, total = sums[0], sums[1]
        ctx.save_for_backward(exp / total.unsqueeze(-1), local, inside)
        return total.log() - picked  # (N,)

    @staticmethod
    def backward(ctx, g):
        softmax, local, inside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1), -inside.to(grad.dtype).unsqueeze(-1))
        return grad * g.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, *, start: int, group
) -> torch.Tensor:
    """Per-token loss (N,) from local logits (N, V/tp) whose columns start at ``start``."""
    if group_size(group) == 1:
        return F.cross_entropy(logits.float(), target, reduction="none")
    return _VocabParallelCE.apply(logits, target, start, group)
