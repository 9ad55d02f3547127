"""Optimizers that update the sharded master parameters, and the learning-rate schedule.

Both work on the flat slices that ``ShardedDataParallel`` gives each DP rank (one float32
master tensor per bucket, with its reduced gradient slice and a per-element weight-decay mask):

* :class:`ShardedAdamW` — torch's ``AdamW``, run on the slices. Adam is element-wise, so a
  slice updates exactly as the full tensor would. Decoupled weight decay is applied only to
  matrices (``dim >= 2``, not norms or biases): the optimizer runs with ``weight_decay=0`` and
  the masked decay ``w *= 1 - lr * wd * mask`` is applied first, exactly where torch's AdamW
  applies its own.
* :class:`ShardedLamb` — LAMB (You et al., 2019): the Adam direction ``u = m̂/(sqrt(v̂)+eps)
  + wd * w`` is scaled per parameter by the trust ratio ``||w|| / ||u||`` (1 when either is
  zero). Those norms are norms of *whole* parameters, whose elements are spread over DP ranks
  (a bucket slice cuts parameters anywhere) and, for a TP-split parameter, over TP ranks. Each
  rank therefore sums the squares of its elements per parameter and the sums are all-reduced
  over the DP group and the TP group (``ShardedDataParallel.param_sq_norms``; a parameter
  replicated over TP is counted once). Two all-reduces of one float per parameter per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from trainer.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over ``cfg.warmup`` steps (step 0 gets lr/warmup), then a cosine from
    ``lr`` down to ``min_lr_ratio * lr`` at ``cfg.steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    floor = cfg.min_lr_ratio
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


class ShardedAdamW:
    """torch.optim.AdamW over master slices, with masked decoupled weight decay."""

    def __init__(
        self, masters: list[torch.Tensor], decay: list[torch.Tensor], cfg: TrainConfig
    ) -> None:
        self.masters = [torch.nn.Parameter(m, requires_grad=False) for m in masters]
        self.decay, self.wd = decay, cfg.weight_decay
        # one fused kernel per step on a GPU (torch's foreach default elsewhere)
        fused = bool(masters) and all(m.is_cuda for m in masters)
        self.opt = torch.optim.AdamW(
            self.masters, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=0.0,
            fused=fused or None,
        )  # fmt: skip

    def step(self, grads: list[torch.Tensor], lr: float) -> None:
        """One update of the masters from ``grads`` at ``lr``: the masked weight decay, then AdamW's
        step."""
        for m, g, mask in zip(self.masters, grads, self.decay, strict=True):
            m.grad = g
            if self.wd:
                m.data.mul_(1 - lr * self.wd * mask)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        for m in self.masters:
            m.grad = None

    def state_dict(self) -> dict[str, Any]:
        """torch's AdamW state."""
        return self.opt.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned."""
        self.opt.load_state_dict(state)


class ShardedLamb:
    """LAMB over master slices. ``param_sq_norms(values_per_slice) -> (n_params,)`` returns
    the squared norms of whole parameters (see the module docstring); ``segments`` maps each
    element of a slice to its parameter index (``n_params`` for padding)."""

    def __init__(
        self,
        masters: list[torch.Tensor],
        decay: list[torch.Tensor],
        segments: list[torch.Tensor],
        param_sq_norms: Callable[[list[torch.Tensor]], torch.Tensor],
        cfg: TrainConfig,
    ) -> None:
        self.masters, self.decay, self.segments = masters, decay, segments
        self.param_sq_norms = param_sq_norms
        self.cfg = cfg
        self.m = [torch.zeros_like(w) for w in masters]
        self.v = [torch.zeros_like(w) for w in masters]
        self.t = 0

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], lr: float) -> None:
        """One LAMB update of the masters from ``grads`` at ``lr`` (the module docstring)."""
        b1, b2 = self.cfg.betas
        self.t += 1
        c1, c2 = 1 - b1**self.t, 1 - b2**self.t
        updates = []
        for w, g, m, v, mask in zip(self.masters, grads, self.m, self.v, self.decay, strict=True):
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            u = (m / c1) / ((v / c2).sqrt() + self.cfg.eps)
            updates.append(u.add_(w * mask, alpha=self.cfg.weight_decay))
        w_norm = self.param_sq_norms(self.masters).sqrt()
        u_norm = self.param_sq_norms(updates).sqrt()
        ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
        ratio = torch.cat([ratio, ratio.new_ones(1)])  # padding elements
        for w, u, seg in zip(self.masters, updates, self.segments, strict=True):
            w.sub_(u * ratio[seg], alpha=lr)

    def state_dict(self) -> dict[str, Any]:
        """The step count and the moments (the live tensors, as torch's state_dict gives them)."""
        return {"t": self.t, "m": list(self.m), "v": list(self.v)}  # live, as torch's

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned, copying into the moments in place."""
        self.t = int(state["t"])
        for dst, src in zip(self.m + self.v, list(state["m"]) + list(state["v"]), strict=True):
            dst.copy_(src)


def build_optimizer(
    cfg: TrainConfig,
    *,
    masters: list[torch.Tensor],
    decay: list[torch.Tensor],
    segments: list[torch.Tensor],
    param_sq_norms: Callable[[list[torch.Tensor]], torch.Tensor],
) -> ShardedAdamW | ShardedLamb:
    """The optimizer named by ``cfg.optimizer`` over the given master slices (updated in place)."""
    if cfg.optimizer == "lamb":
        return ShardedLamb(masters, decay, segments, param_sq_norms, cfg)
    return ShardedAdamW(masters, decay, cfg)
