"""The training engine: one rank's stage of the GPT, its pipeline schedule and its optimizer shard.

``Engine(model_cfg, train_cfg, mesh, hooks)`` builds the whole GPT from the seed on every rank
(so every shard is a slice of the same model and a sharded run starts exactly where the
one-process run starts), applies TP/SP and the pipeline split (``parallel.apply``), moves the
parameters into flat DP buckets (``parallel.data_parallel``) and builds the optimizer over this
rank's slice of them (``optim``).

``train_step(batch, loss_weight)``, with ``batch`` int64 (microbatches, rows, seq_len + 1):
``rows`` is micro_batch_size, or more on a replica a ``seq_skew`` fault gives more tokens; its
``loss_weight`` is its rows over the replicas' mean rows (1 when they are equal).

1. 1F1B over the microbatches (``parallel.pipeline``), each forward and backward inside
   ``hooks.span("forward"|"backward", "compute", mb)``; the last stage's loss is multiplied by
   ``loss_weight`` and divided by the number of microbatches so the gradients are those of the
   mean over every token of the global batch (a mixture of experts' load-balancing loss is
   scaled alike, ``trainer/moe.py``). During the last
   microbatch's backward, full gradient buckets are reduce-scattered over DP in the
   background.
2. Inside ``hooks.span("optimizer", "compute")``: wait for the reductions, clip by the
   global gradient norm, update this rank's master slice, all-gather the parameters. With
   ``optimizer_offload`` a share of the slice is updated on a host thread and its buckets are
   gathered when the next forward first uses them (``trainer/offload.py``).
3. The loss: the last stage's mean over microbatches, weighted, summed over the pipeline group (other
   stages contribute 0) and averaged over DP and CP (each CP rank's loss is the mean over its
   chunk of the sequences), so every rank returns the same value.

A world of one rank (dp = pp = tp = cp = 1) is the one-process reference: the same code with every
collective skipped.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any

import torch
import torch.distributed as dist

from trainer import recompute
from trainer.config import ModelConfig, TrainConfig, check_compatible
from trainer.hooks import Hooks, NullHooks
from trainer.model import GPT, count_params, flops_per_token
from trainer.moe import set_aux_loss_scale
from trainer.offload import OffloadedAdamW
from trainer.optim import ShardedAdamW, ShardedLamb, build_optimizer, lr_at
from trainer.parallel.apply import gather_full_params, parallelize
from trainer.parallel.data_parallel import ShardedDataParallel
from trainer.parallel.mesh import Mesh
from trainer.parallel.pipeline import P2P, one_f_one_b
from trainer.parallel.tensor import group_size

log = logging.getLogger(__name__)


def _device(train_cfg: TrainConfig) -> torch.device:
    if train_cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("train.device is cuda but no CUDA device is available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def compile_unavailable(device: torch.device) -> str | None:
    """Why ``torch.compile`` cannot run on ``device`` (a missing compiler or Triton, an
    unsupported platform), or None when it can: a tiny function is compiled and run forward
    and backward, so a broken toolchain is found before the first step, not inside it."""
    try:
        fn = torch.compile(lambda x: torch.nn.functional.gelu(x * 2.0).sum())
        x = torch.ones(8, device=device, requires_grad=True)
        fn(x).backward()
    except Exception as e:  # any failure of the toolchain: run eager
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    return None


class Engine:
    """See the module docstring. Public attributes: ``stage`` (this rank's module), ``mesh``,
    ``step`` (steps done), ``n_params`` (whole model), ``flops_per_token``, ``last_lr``,
    ``last_grad_norm`` (a 0-d tensor on the device, read it when logging: that syncs; None when
    clipping is off)."""

    def __init__(
        self, model_cfg: ModelConfig, train_cfg: TrainConfig, mesh: Mesh, hooks: Hooks | None = None
    ) -> None:
        check_compatible(model_cfg, mesh.parallel, train_cfg)
        self.model_cfg, self.cfg, self.mesh = model_cfg, train_cfg, mesh
        self.hooks = hooks or NullHooks()
        self.device = _device(train_cfg)
        self.n_params = count_params(model_cfg)
        self.flops_per_token = flops_per_token(model_cfg)
        torch.manual_seed(train_cfg.seed)
        if self.device.type == "cuda":
            with torch.device(self.device):  # initialise on the GPU: fast for large models
                model = GPT(model_cfg)
        else:
            model = GPT(model_cfg)
        self.stage = parallelize(model, mesh, sp=mesh.parallel.sp)
        self._mb = -1  # the microbatch in flight (the recompute span's)
        recompute.apply(self.stage, train_cfg.recompute, self.hooks, lambda: self._mb)
        if train_cfg.compiles:
            why = compile_unavailable(self.device)
            if why is None:
                for block in self.stage.h.values():
                    block.compile()
            else:
                log.warning("torch.compile is not usable here (%s): the blocks run eager", why)
        self.dp = ShardedDataParallel(
            self.stage,
            mesh,
            bucket_numel=train_cfg.bucket_numel,
            sp=self.stage.sp,
            tp_sharded=self.stage.is_tp_sharded,
            expert=self.stage.is_expert,
        )
        buckets = self.dp.buckets
        self.offload: OffloadedAdamW | None = None
        self.optimizer: ShardedAdamW | ShardedLamb | OffloadedAdamW
        if train_cfg.optimizer_offload > 0:  # a share of the state on the host (trainer/offload.py)
            self.offload = OffloadedAdamW(
                buckets, train_cfg, gather=self.dp.gather_bucket, hooks=self.hooks
            )
            self.offload.install(self.stage)
            self.optimizer = self.offload
        else:
            self.optimizer = build_optimizer(
                train_cfg,
                masters=[b.master for b in buckets],
                decay=[b.decay for b in buckets],
                segments=[b.seg for b in buckets],
                param_sq_norms=self.dp.param_sq_norms,
            )
        self.step = 0
        self.last_lr = 0.0
        self.last_grad_norm: torch.Tensor | None = None
        log.info(
            "%s: layers %s, %d parameters in the model",
            mesh.describe(),
            self.stage.layers,
            self.n_params,
        )

    # -- one step ------------------------------------------------------------------------------
    def _autocast(self):
        if self.cfg.dtype == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self, batch: torch.Tensor, loss_weight: float = 1.0) -> float:
        """One optimizer step on this DP rank's ``batch``; returns the global mean loss."""
        return float(self.train_step_async(batch, loss_weight))

    def train_step_async(self, batch: torch.Tensor, loss_weight: float = 1.0) -> torch.Tensor:
        """:meth:`train_step` without reading the loss: it comes back as a one-element tensor
        on the device, so the host can queue the next step before this one's kernels end
        (reading it, ``float(loss)``, waits for them). ``loss_weight``: this DP replica's rows
        over the mean rows of the replicas (1 when they are equal), which its loss and
        gradients are scaled by so that they stay the mean over every token of the global
        batch."""
        M, B, T1 = batch.shape
        cfg = self.model_cfg
        if cfg.seq_len + 1 != T1:
            raise ValueError(
                f"batch has sequences of {T1} tokens, expected seq_len + 1 = {cfg.seq_len + 1}"
            )
        if self.device.type == "cuda" and batch.device.type == "cpu" and not batch.is_pinned():
            batch = batch.pin_memory()  # a copy from pageable memory would wait for the device
        batch = batch.to(self.device, non_blocking=True)
        inputs, targets = batch[..., :-1], batch[..., 1:]
        p2p = P2P(self.mesh, (B, self.stage.local_seq_len, cfg.d_model), self.device)
        losses: list[torch.Tensor] = []
        if self.offload is not None:
            self.offload.before_zero_grads()
        self.dp.zero_grads()
        set_aux_loss_scale(self.stage, loss_weight / M)  # MoE: scaled as the loss is

        def forward(mb: int, x: torch.Tensor | None) -> torch.Tensor:
            self._mb = mb
            with self.hooks.span("forward", "compute", mb), self._autocast():
                if x is not None:
                    x.requires_grad_()
                inp = inputs[mb] if self.stage.first else x
                out = self.stage(inp, targets[mb] if self.stage.last else None)
            if self.stage.last:
                losses.append(out.detach().float())
                out = out * loss_weight / M
            return out

        def backward(mb: int, x, y: torch.Tensor, dy) -> torch.Tensor | None:
            self._mb = mb
            with self.hooks.span("backward", "compute", mb):
                self.dp.final_microbatch = mb == M - 1
                torch.autograd.backward(y, None if dy is None else dy.to(y.dtype))
            return None if x is None else x.grad

        one_f_one_b(M, p2p, forward, backward)
        with self.hooks.span("optimizer", "compute"):
            self._update()
        self.step += 1
        return self._global_loss(losses, M, loss_weight)

    def _update(self) -> None:
        self.dp.finish_grads()
        if self.cfg.grad_clip > 0:
            # on the device: no host sync between the backward and the optimizer, so the
            # host keeps queuing kernels (a multiply by 1 where the norm is under the clip)
            norm = self.dp.global_grad_norm()
            self.last_grad_norm = norm
            self.dp.scale_grads((self.cfg.grad_clip / (norm + 1e-6)).clamp(max=1.0))
        self.last_lr = lr_at(self.step, self.cfg)
        grads = [b.shard_grad for b in self.dp.buckets]
        if self.offload is not None:  # the host share comes back during the next forward
            self.offload.step(grads, self.last_lr, self.step)
            self.dp.gather_params(skip=self.offload.pending)
        else:
            self.optimizer.step(grads, self.last_lr)
            self.dp.gather_params()

    def _global_loss(self, losses: list[torch.Tensor], M: int, weight: float = 1.0) -> torch.Tensor:
        value = torch.stack(losses).mean() if losses else torch.zeros((), device=self.device)
        value = value.reshape(1).float() * weight  # a replica's mean, weighted by its rows
        for axis in ("pp", "dp", "cp"):  # CP ranks hold the means of equal chunks
            group = self.mesh.groups.get(axis)
            if group_size(group) > 1:
                dist.all_reduce(value, group=group)
        return value[0] / (self.mesh.size("dp") * self.mesh.size("cp"))

    # -- state -----------------------------------------------------------------------------
    def state_dict(self, *, live: bool = False) -> dict[str, Any]:
        """This rank's shard: its stage's parameters (TP shards, replicated over DP), its DP
        slice of the masters and optimizer state, the step and the RNG states. A copy, or
        with ``live`` the engine's own tensors (a checkpoint's snapshot copies them once)."""
        self.settle()
        rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        own = (lambda t: t.detach()) if live else (lambda t: t.detach().clone())
        optimizer = self.optimizer.state_dict()
        return {
            "model": {k: own(v) for k, v in self.stage.state_dict().items()},
            "masters": [own(b.master) for b in self.dp.buckets],
            "optimizer": optimizer if live else copy.deepcopy(optimizer),  # not live tensors
            "step": self.step,
            "rng": rng,
            "coords": dict(self.mesh.coords),
            "mesh": dict(self.mesh.sizes),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a shard saved by :meth:`state_dict` on the same mesh coordinates."""
        if state.get("mesh", self.mesh.sizes) != self.mesh.sizes:
            raise ValueError(
                f"checkpoint mesh {state['mesh']} differs from this run's {self.mesh.sizes}"
            )
        with torch.no_grad():
            self.stage.load_state_dict(state["model"])
            for b, m in zip(self.dp.buckets, state["masters"], strict=True):
                b.master.copy_(m)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        torch.set_rng_state(state["rng"]["cpu"])
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)

    def full_params(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters (plain GPT names) gathered on every rank (small models)."""
        self.settle()
        return gather_full_params(self.stage, self.mesh)

    def settle(self) -> None:
        """Bring every offloaded bucket's parameters back and gather them (a collective over
        each bucket's group: every rank calls it at the same point); nothing without offload."""
        if self.offload is not None:
            self.offload.ensure_all()

    def close(self) -> None:
        """Stop the offload thread once its work is done (no collective)."""
        if self.offload is not None:
            self.offload.drain()
            self.offload.close()
