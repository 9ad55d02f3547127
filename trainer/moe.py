"""A mixture-of-experts MLP: a linear router, top-k routing, dropless experts.

Every token is routed to ``top_k`` of ``experts`` GELU MLPs, each of the dense MLP's shape
(``d_model -> ff -> d_model``). The router is a linear layer (no bias) whose softmax gives each
token a probability per expert; the token goes to its ``top_k`` most probable experts and
their outputs are summed, weighted by those probabilities renormalised to sum to one. No
token is dropped: an expert takes every token routed to it, however many (no capacity).

Load balancing. The auxiliary loss of Switch Transformer and GShard,
``E * sum_i f_i * P_i`` (``f_i`` the share of the token assignments that go to expert ``i``,
``P_i`` the mean router probability of ``i``; 1 when the load is even), times
:data:`AUX_LOSS_COEF` = 0.01. It is computed over each sequence (over the rank's chunk of it
under context or sequence parallelism) and averaged over the sequences, so that a data-parallel
or pipelined run adds up to the same loss as the one-process run on the same global batch.
It joins the training loss through its gradient only (:class:`_AuxLossGrad`, an identity on
the layer's output that gives the auxiliary loss the gradient ``aux_loss_scale`` in the
backward), so it works the same on every pipeline stage and the reported loss stays the
cross-entropy, comparable with a dense model's. The engine sets ``aux_loss_scale`` to the
factor it applies to each microbatch's loss (``1 / microbatches``); a plain
``GPT(idx, targets).backward()`` uses 1.

Dispatch. Token assignments are sorted by expert and each expert runs on its contiguous run
of them. With expert parallelism (``trainer/parallel/expert.py``) the layer holds only its
share of the experts (``experts`` is a ``ModuleDict`` keyed by the global expert id, so the
parameter names are those of the whole model) and a ``dispatcher`` exchanges the sorted tokens
with the ranks that hold their experts and brings the outputs back.

Work records. Each forward records, for each expert this rank holds, the token assignments it
received (``tracer.record_work("expert_tokens", n, key=expert)``): a no-op when no tracer is
attached, and the counts are on the host already (the split sizes need them).

The ``hot_expert:expert=E,share=S`` fault (:func:`set_hot_expert`, docs/spec.md §5). Every
router sends a share ``S`` of its token assignments to expert ``E``: of the ``n`` tokens of a
forward, a share ``q`` already has ``E`` among its top-k, so ``(S * k - q) / (1 - q)`` of the
others (none when that is negative, all when above one) are *forced* to it, chosen evenly in
token order (deterministic). A forced token's experts become ``E`` followed by its first
``k - 1`` choices, with its top-k weights in the same order (``E`` takes the top weight). ``E``
then receives ``S`` of the assignments (at most ``1 / k``: a token goes to an expert once).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig

try:
    from tracer import record_work
except ImportError:  # the trainer without the tracer

    def record_work(*args, **kwargs) -> None:
        """Nothing: the trainer runs without the tracer."""
        return None


AUX_LOSS_COEF = 0.01
"""Weight of the load-balancing loss in the training loss (Switch Transformer's 0.01)."""


class _AuxLossGrad(torch.autograd.Function):
    """``y`` unchanged; in the backward, ``aux`` gets the gradient ``scale``."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return dy, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def balance_loss(probs: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Switch/GShard load-balancing loss per sequence, averaged over the sequences.
    ``probs`` (B, T, E) router probabilities, ``idx`` (B, T, k) the chosen experts."""
    B, T, E = probs.shape
    counts = torch.zeros(B, E, device=probs.device, dtype=probs.dtype)
    counts.scatter_add_(
        1, idx.reshape(B, -1), torch.ones_like(idx.reshape(B, -1), dtype=probs.dtype)
    )
    f = counts / idx[0].numel()  # (B, E): share of the sequence's assignments
    P = probs.mean(dim=1)  # (B, E)
    return E * (f * P).sum(dim=-1).mean()


def force_expert(
    idx: torch.Tensor, weights: torch.Tensor, expert: int, share: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The hot_expert fault (module docstring): send ``share`` of the assignments to
    ``expert``. ``idx``, ``weights`` (N, k); returns them with the forced tokens rewritten."""
    N, k = idx.shape
    has = (idx == expert).any(dim=-1)  # (N,)
    q = has.float().mean()
    h = ((share * k - q) / (1 - q).clamp(min=1e-9)).clamp(0.0, 1.0)  # share of the others
    r = torch.cumsum((~has).long(), 0) - 1  # (N,) rank among the others
    forced = ~has & (torch.floor((r + 1) * h) > torch.floor(r * h))  # evenly spread, h of them
    hot = torch.full_like(idx[:, :1], expert)
    new_idx = torch.cat([hot, idx[:, : k - 1]], dim=-1)  # (N, k): E first, then its top k-1
    return torch.where(forced[:, None], new_idx, idx), weights


class MoE(nn.Module):
    """Router and experts (module docstring). ``forward`` (B, T, C) -> (B, T, C).
    ``expert`` builds one expert from the config (the model passes its dense MLP)."""

    def __init__(self, cfg: ModelConfig, expert: Callable[[ModelConfig], nn.Module]) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.experts, cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.experts, bias=False)
        # each expert is ``expert(cfg)``: the model's dense MLP (its shape and parameter names)
        self.experts = nn.ModuleDict({str(e): expert(cfg) for e in range(cfg.experts)})
        # expert parallelism installs an ExpertDispatcher here (trainer/parallel/expert.py)
        self.dispatcher: Callable[..., tuple[torch.Tensor, list[int]]] | None = None
        self.aux_loss_scale = 1.0  # the gradient the auxiliary loss gets (module docstring)
        self.hot: tuple[int, float] | None = None  # the hot_expert fault: (expert, share)
        self.last_aux: torch.Tensor | None = None  # the last forward's balance loss (detached)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router probabilities (B, T, E) (float32), chosen experts (B, T, k) and their
        renormalised weights (B, T, k)."""
        B, T, _ = x.shape
        probs = F.softmax(self.router(x).float(), dim=-1)  # (B, T, E)
        weights, idx = probs.topk(self.top_k, dim=-1)  # (B, T, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.hot is not None:
            flat_idx, flat_w = force_expert(
                idx.reshape(B * T, -1), weights.reshape(B * T, -1), *self.hot
            )
            idx, weights = flat_idx.view(B, T, -1), flat_w.view(B, T, -1)
        return probs, idx, weights

    @torch.compiler.disable  # shapes depend on the routing: eager inside a compiled block
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route each token to its ``top_k`` experts, run them (through the ``dispatcher`` under
        expert parallelism) and sum their outputs by the router's weights; records the tokens each
        local expert received, and in training the load-balancing loss rides on the backward."""
        B, T, C = x.shape
        probs, idx, weights = self.route(x)
        tokens = x.reshape(B * T, C)  # (N, C)
        flat = idx.reshape(-1)  # (N*k,): the expert of each assignment
        order = torch.argsort(flat, stable=True)  # assignments sorted by expert
        counts = torch.bincount(flat, minlength=self.n_experts)  # (E,)
        xs = tokens[order // self.top_k]  # (N*k, C)
        if self.dispatcher is None:
            received = counts.tolist()  # the one host sync: the split sizes
            ys = self.run_experts(xs, received)
        else:
            ys, received = self.dispatcher(xs, counts, self.run_experts)
        self._record(received)
        ys = ys * weights.reshape(-1)[order, None].to(ys.dtype)  # (N*k, C)
        out = torch.zeros_like(tokens).index_add_(0, order // self.top_k, ys.to(tokens.dtype))
        y = out.view(B, T, C)
        if torch.is_grad_enabled() and probs.requires_grad:
            aux = AUX_LOSS_COEF * balance_loss(probs, idx)
            self.last_aux = aux.detach()
            y = _AuxLossGrad.apply(y, aux, self.aux_loss_scale)
        return y

    def run_experts(self, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each local expert, in id order, on its run of ``xs`` (n, C); ``counts`` the run
        lengths. Returns (n, C)."""
        chunks = xs.split(counts)
        outs = [expert(chunk) for expert, chunk in zip(self.experts.values(), chunks, strict=True)]
        return torch.cat(outs) if outs else xs

    def _record(self, received: list[int]) -> None:
        if _in_backward():  # a recompute pass: recorded in the forward already
            return
        for expert, n in zip(self.experts, received, strict=True):
            record_work("expert_tokens", n, key=int(expert))


def _in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def moe_layers(module: nn.Module) -> list[MoE]:
    """Every MoE layer of ``module``."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def set_aux_loss_scale(module: nn.Module, scale: float) -> None:
    """The gradient every MoE layer of ``module`` gives its auxiliary loss."""
    for m in moe_layers(module):
        m.aux_loss_scale = scale


def set_hot_expert(module: nn.Module, expert: int, share: float) -> None:
    """Install the hot_expert fault (module docstring) in every router of ``module``."""
    for m in moe_layers(module):
        m.hot = (expert, share)
