"""Data parallelism with a sharded optimizer (ZeRO-1/2 style), without DDP or FSDP.

Layout. The stage's parameters are grouped, in reverse registration order (roughly the order
in which backward produces their gradients), into buckets of about ``bucket_numel`` elements.
Each bucket owns two flat float32 buffers, padded to a multiple of the DP size: ``params``
and ``grads``. Every parameter's ``.data`` and ``.grad`` become views into them, so autograd
accumulates straight into the flat gradient buffer. DP rank ``d`` owns the slice
``[d * S, (d + 1) * S)`` of each bucket: a float32 *master* copy of those parameters, its
optimizer state, and the reduced gradient of the slice.

One step:

1. Backward. A post-accumulate-grad hook on every parameter counts, during the last
   microbatch's backward, the parameters of each bucket whose gradient is complete. (Under
   sequence parallelism the parameters that are not TP-split — norms, row-parallel biases,
   position embeddings — saw only a slice of the sequence; their gradient is first
   all-reduced over the TP group.) When a bucket is complete its gradient, divided by the DP
   size (by DP x CP, see 2), is reduce-scattered over the DP group with ``async_op=True``, overlapping the rest
   of the backward.
2. :meth:`ShardedDataParallel.finish_grads` launches any bucket not yet launched and waits for all.
   Under context parallelism (``cp > 1``) the CP ranks hold the same parameters and each saw
   one chunk of the sequences, so the gradient is averaged over ``dp x cp``, as Megatron folds
   CP into the data-parallel gradient group: the bucket is divided by ``dp * cp``,
   reduce-scattered over DP as above, and the reduced slice is then all-reduced over the CP
   group (with ``dp = 1`` the slice is the whole bucket, and its CP all-reduce is the one
   launched in the backward). The optimizer stays sharded over DP only: the CP ranks of a DP
   rank hold the same slice and take the same step (``parallel.context`` says why).
3. The optimizer (``trainer.optim``) updates the masters from the reduced slices.
4. :meth:`ShardedDataParallel.gather_params` all-gathers the masters into the flat parameter
   buffers, so every DP rank holds the updated parameters again.

Expert parallelism (``ep > 1``, ``parallel.expert``). The experts' parameters differ between
the members of an ``ep`` group and are replicated over the ``edp`` group. They get buckets of
their own, sharded, reduced and gathered over ``edp`` instead of DP (each bucket carries its
group); their gradient is still divided by ``dp * cp``, since each holder's gradient already
sums its ep group's tokens. Every element of the model is then held by exactly one DP rank
(a dense slice by its DP rank, an expert slice by its ``edp`` rank within the holders of that
expert), so the global gradient norm is still one all-reduce over DP, TP and PP.

Memory: optimizer state and masters are 1/dp per rank (ZeRO-1), and only the reduced slice of
each gradient is kept for the update (ZeRO-2's point, though the full flat buffer stays
allocated here for simplicity).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from trainer.parallel.mesh import Mesh
from trainer.parallel.tensor import group_size

log = logging.getLogger(__name__)


@dataclass
class Bucket:
    """One flat bucket. ``seg``/``decay``/``norm_weight`` describe this rank's slice
    element by element: the stage-local index of the parameter each element belongs to
    (``n_params`` for padding), whether weight decay applies, and the weight of the element
    in a global gradient norm (1, or 1/tp for a parameter replicated over the TP group, 0 for
    padding). ``group`` (of ``size`` ranks, this one at ``index``) is the group the bucket is
    sharded and reduced over: DP, or ``edp`` for the experts' buckets."""

    names: list[str]
    params: list[nn.Parameter]
    param_buf: torch.Tensor
    grad_buf: torch.Tensor
    master: torch.Tensor
    shard_grad: torch.Tensor
    seg: torch.Tensor
    decay: torch.Tensor
    norm_weight: torch.Tensor
    group: dist.ProcessGroup | None
    size: int
    index: int
    expert: bool = False
    done: set[str] = field(default_factory=set)
    work: dist.Work | None = None
    launched: bool = False


class ShardedDataParallel:
    """Gradient reduce-scatter in buckets, overlapped with backward, and parameter all-gather.

    ``tp_sharded(name)`` says whether a parameter is split over the TP group (it then counts
    fully in norms and needs no TP gradient all-reduce under SP); ``expert(name)`` whether it
    is an expert's, sharded over the ``ep`` group (its buckets then go over ``edp``)."""

    def __init__(
        self,
        stage: nn.Module,
        mesh: Mesh,
        *,
        bucket_numel: int,
        sp: bool,
        tp_sharded: Callable[[str], bool],
        expert: Callable[[str], bool] = lambda name: False,
    ) -> None:
        self.dp_group, self.tp_group = mesh.groups.get("dp"), mesh.groups.get("tp")
        self.dp, self.dp_rank = mesh.size("dp"), mesh.index("dp")
        self.edp_group, self.edp, self.edp_rank = (
            mesh.groups.get("edp"), mesh.size("edp"), mesh.index("edp")
        )  # fmt: skip
        self.cp_group, self.cp = mesh.groups.get("cp"), mesh.size("cp")
        self.tp = mesh.size("tp")
        self.norm_groups = [mesh.groups.get(a) for a in ("dp", "tp", "pp")]
        self.sp_allreduce = {
            n for n, _ in stage.named_parameters() if sp and self.tp > 1 and not tp_sharded(n)
        }
        named = list(stage.named_parameters())
        self.names = [n for n, _ in named]
        self.replicated = torch.tensor([0.0 if tp_sharded(n) else 1.0 for n in self.names])
        self.final_microbatch = True
        self.buckets: list[Bucket] = []
        pending: dict[bool, list[tuple[int, str, nn.Parameter]]] = {False: [], True: []}
        for index in reversed(range(len(named))):
            is_expert = expert(named[index][0])
            group = pending[is_expert]
            group.append((index, *named[index]))
            if sum(p.numel() for _, _, p in group) >= bucket_numel:
                self.buckets.append(self._make_bucket(group, is_expert))
                pending[is_expert] = []
        for is_expert, group in pending.items():
            if group:
                self.buckets.append(self._make_bucket(group, is_expert))
        self._owner = {id(p): b for b in self.buckets for p in b.params}
        for b in self.buckets:
            for name, p in zip(b.names, b.params, strict=True):
                p.register_post_accumulate_grad_hook(self._hook(name))
        log.debug(
            "%d buckets of %s elements",
            len(self.buckets),
            [b.param_buf.numel() for b in self.buckets],
        )

    def _make_bucket(self, group: list[tuple[int, str, nn.Parameter]], expert: bool) -> Bucket:
        size, rank = (self.edp, self.edp_rank) if expert else (self.dp, self.dp_rank)
        numel = sum(p.numel() for _, _, p in group)
        padded = -(-numel // size) * size
        dev = group[0][2].device
        param_buf = torch.zeros(padded, dtype=torch.float32, device=dev)
        grad_buf = torch.zeros(padded, dtype=torch.float32, device=dev)
        seg = torch.full((padded,), len(self.names), dtype=torch.long)
        decay = torch.zeros(padded)
        weight = torch.zeros(padded)
        offset = 0
        for index, _name, p in group:
            n = p.numel()
            param_buf[offset : offset + n].copy_(p.detach().reshape(-1))
            p.data = param_buf[offset : offset + n].view_as(p)
            p.grad = grad_buf[offset : offset + n].view_as(p)
            seg[offset : offset + n] = index
            decay[offset : offset + n] = 1.0 if p.dim() >= 2 else 0.0
            weight[offset : offset + n] = 1.0 / self.tp if self.replicated[index] else 1.0
            offset += n
        lo, hi = rank * (padded // size), (rank + 1) * (padded // size)
        return Bucket(
            names=[n for _, n, _ in group],
            params=[p for _, _, p in group],
            param_buf=param_buf,
            grad_buf=grad_buf,
            master=param_buf[lo:hi].clone(),
            shard_grad=grad_buf[lo:hi] if size == 1 else torch.zeros_like(param_buf[lo:hi]),
            seg=seg[lo:hi].to(dev),
            decay=decay[lo:hi].to(dev),
            norm_weight=weight[lo:hi].to(dev),
            group=self.edp_group if expert else self.dp_group,
            size=size,
            index=rank,
            expert=expert,
        )

    # -- backward ------------------------------------------------------------------------------
    def _hook(self, name: str):
        def on_grad(p: torch.Tensor) -> None:
            if not self.final_microbatch:
                return
            if name in self.sp_allreduce:
                dist.all_reduce(p.grad, group=self.tp_group)
            bucket = self._owner[id(p)]
            bucket.done.add(name)
            if len(bucket.done) == len(bucket.params):
                self._launch(bucket)

        return on_grad

    def _launch(self, b: Bucket) -> None:
        b.launched = True
        if self.dp * self.cp > 1:
            b.grad_buf.div_(self.dp * self.cp)
        if b.size > 1:
            b.work = dist.reduce_scatter_single(
                b.shard_grad, b.grad_buf, group=b.group, async_op=True
            )
        elif self.cp > 1:  # shard_grad is the whole bucket
            b.work = dist.all_reduce(b.shard_grad, group=self.cp_group, async_op=True)

    def finish_grads(self) -> None:
        """Launch the buckets whose hooks did not all fire, then wait for every reduction."""
        for b in self.buckets:
            if not b.launched:
                for name, p in zip(b.names, b.params, strict=True):
                    if name not in b.done and name in self.sp_allreduce:
                        dist.all_reduce(p.grad, group=self.tp_group)
                self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            b.work, b.launched = None, False
            b.done.clear()
            if b.size > 1 and self.cp > 1:  # the DP-reduced slice, summed over CP
                b.work = dist.all_reduce(b.shard_grad, group=self.cp_group, async_op=True)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None

    def zero_grads(self) -> None:
        """Zero every bucket's gradient buffer."""
        for b in self.buckets:
            b.grad_buf.zero_()

    # -- norms ---------------------------------------------------------------------------------
    def global_grad_norm(self) -> torch.Tensor:
        """L2 norm of the whole model's gradient: this slice's weighted sum of squares,
        all-reduced over DP (disjoint slices), TP (disjoint shards; replicated parameters
        weighted 1/tp) and PP (disjoint stages); not over CP, whose ranks hold the same slice."""
        sq = sum((b.shard_grad.square() * b.norm_weight).sum() for b in self.buckets)
        sq = torch.as_tensor(sq, dtype=torch.float32).reshape(1).clone()
        for g in self.norm_groups:
            if group_size(g) > 1:
                dist.all_reduce(sq, group=g)
        return sq.sqrt()[0]

    def param_sq_norms(self, per_bucket: list[torch.Tensor]) -> torch.Tensor:
        """Squared L2 norm of every full parameter of the stage, from per-element values laid
        out like the buckets' slices (the masters, or an update): segment sums on this slice,
        all-reduced over DP (the experts' over ``edp``); then over TP, where a TP-split parameter's shards add up and a
        replicated one is counted once. Returns (n_params,)."""
        n = len(self.names)
        out = torch.zeros(n + 1, dtype=torch.float32, device=per_bucket[0].device)
        experts = torch.zeros_like(out)  # summed over edp, not DP (module docstring)
        for b, values in zip(self.buckets, per_bucket, strict=True):
            (experts if b.expert else out).index_add_(0, b.seg, values.float().square())
        if self.dp > 1:
            dist.all_reduce(out, group=self.dp_group)
        if any(b.expert for b in self.buckets):
            if self.edp > 1:
                dist.all_reduce(experts, group=self.edp_group)
            out += experts
        if self.tp > 1:
            dist.all_reduce(out, group=self.tp_group)
            rep = torch.cat([self.replicated, torch.zeros(1)]).to(out.device).bool()
            out = torch.where(rep, out / self.tp, out)
        return out[:n]

    # -- after the update ----------------------------------------------------------------------
    def scale_grads(self, factor: float | torch.Tensor) -> None:
        """Multiply this rank's reduced gradient slices by ``factor`` (gradient clipping)."""
        for b in self.buckets:
            b.shard_grad.mul_(factor)

    def gather_params(self, skip: set[int] | frozenset[int] = frozenset()) -> None:
        """All-gather the updated masters into the flat parameter buffers (every DP rank;
        the experts' over ``edp``), but the buckets whose indices are in ``skip`` (an
        optimizer-offloaded bucket still on its way back: ``trainer.offload`` gathers it)."""
        works = []
        for i, b in enumerate(self.buckets):
            if i in skip:
                continue
            if b.size > 1:
                works.append(
                    dist.all_gather_single(b.param_buf, b.master, group=b.group, async_op=True)
                )
            else:
                b.param_buf.copy_(b.master)
        for w in works:
            w.wait()

    def gather_bucket(self, index: int) -> None:
        """All-gather one bucket's master slices into its parameter buffer (and wait)."""
        b = self.buckets[index]
        if b.size > 1:
            dist.all_gather_single(b.param_buf, b.master, group=b.group)
        else:
            b.param_buf.copy_(b.master)
