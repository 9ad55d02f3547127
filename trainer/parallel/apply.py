"""Apply pipeline and tensor parallelism to a plain GPT from outside (torchtitan style).

``parallelize(model, mesh, sp=...)`` keeps this rank's pipeline stage (its blocks; the token
embedding on the first stage; the final norm and head on the last) and swaps, on a TP group
of more than one rank, each linear for its column- or row-parallel shard:

* attention ``c_attn`` (q, k, v) column-parallel by heads, ``c_proj`` row-parallel;
* MLP ``c_fc`` column-parallel, ``c_proj`` row-parallel;
* the token embedding vocabulary-parallel, the output head column-parallel over the
  vocabulary, followed by the vocabulary-parallel cross-entropy.

A mixture-of-experts MLP is not split over TP (its router and experts stay whole on every TP
rank); on an ``ep`` group of more than one rank each rank keeps its share of the experts and
exchanges tokens with the others (``parallel.expert``).

On a CP group of more than one rank the stage keeps its chunk of each sequence (inputs and
targets) and every attention gets the Ulysses all-to-alls (``parallel.context``).

Shards are sliced from the full, seeded model, so a sharded run starts exactly where the
one-process model starts. Parameter names stay those of the plain GPT (``h.3.mlp.c_fc.weight``)
and ``StageModule.shards`` records, for each TP-split parameter, the dimension and the indices
of the full tensor it holds, so the full model can be put back together
(:func:`gather_full_params`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.model import GPT
from trainer.moe import MoE
from trainer.parallel.context import apply_context_parallel, local_chunk
from trainer.parallel.expert import gather_experts, is_expert_param, shard_experts
from trainer.parallel.mesh import Mesh
from trainer.parallel.pipeline import stage_layers
from trainer.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    group_size,
    vocab_parallel_cross_entropy,
)


class StageModule(nn.Module):
    """One pipeline stage on one TP and CP rank. ``forward(x, targets)``: on the first stage
    ``x`` is the tokens of whole sequences (B, T), of which the stage keeps its CP chunk;
    elsewhere the previous stage's activations (B, ``local_seq_len``, C). ``targets`` are
    whole sequences too. Returns the activations, or on the last stage the mean loss over this
    microbatch's tokens of the CP chunk."""

    def __init__(self, model: GPT, mesh: Mesh, sp: bool) -> None:
        super().__init__()
        cfg = model.cfg
        self.cfg = cfg
        self.tp_group = mesh.groups.get("tp")
        self.tp, self.tp_rank = mesh.size("tp"), mesh.index("tp")
        self.sp = sp and self.tp > 1
        self.cp, self.cp_rank = mesh.size("cp"), mesh.index("cp")
        self.ep = mesh.size("ep")
        # tokens per rank between the blocks: the CP chunk, split over TP under SP
        self.local_seq_len = cfg.seq_len // self.cp // (self.tp if self.sp else 1)
        self.first, self.last = mesh.is_first_stage, mesh.is_last_stage
        self.layers = stage_layers(cfg.n_layer, mesh.size("pp"), mesh.index("pp"))
        self.shards: dict[str, tuple[int, torch.Tensor]] = {}
        self.wte: nn.Module | None = None
        self.wpe: nn.Module | None = None
        self.ln_f: nn.Module | None = None
        self.lm_head: nn.Module | None = None
        self.vocab_start = 0
        if self.first:
            self.wte, self.wpe = model.wte, model.wpe
        self.h = nn.ModuleDict({str(i): model.h[i] for i in self.layers})
        if self.last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head
        if self.tp > 1:
            self._shard()
        shard_experts(self.h, mesh)
        apply_context_parallel(self.h, mesh.groups.get("cp"))

    def _shard(self) -> None:
        cfg, g, sp, r, n = self.cfg, self.tp_group, self.sp, self.tp_rank, self.tp
        span = lambda width: torch.arange(r * width // n, (r + 1) * width // n)  # noqa: E731
        for i, block in self.h.items():
            C, hw = cfg.d_model, span(cfg.d_model)
            qkv_rows = torch.cat([part * C + hw for part in range(3)])
            attn = block.get_submodule("attn")
            attn.c_attn = self._col(f"h.{i}.attn.c_attn", _linear(attn.c_attn), qkv_rows)
            attn.c_proj = self._row(f"h.{i}.attn.c_proj", _linear(attn.c_proj), hw)
            mlp = block.get_submodule("mlp")
            if isinstance(mlp, MoE):
                continue  # experts stay whole over TP (module docstring)
            ff = span(cfg.ff)
            mlp.c_fc = self._col(f"h.{i}.mlp.c_fc", _linear(mlp.c_fc), ff)
            mlp.c_proj = self._row(f"h.{i}.mlp.c_proj", _linear(mlp.c_proj), ff)
        if self.first:
            assert isinstance(self.wte, nn.Embedding)  # the plain model's, not yet sharded
            wte = VocabParallelEmbedding(self.wte, r, g, sp)
            self.wte, self.vocab_start = wte, wte.start
            self.shards["wte.weight"] = (0, span(cfg.vocab_size))
        if self.last:
            vocab = span(cfg.vocab_size)
            self.vocab_start = int(vocab[0])
            self.lm_head = self._col("lm_head", _linear(self.lm_head), vocab)

    def _col(self, name: str, linear: nn.Linear, rows: torch.Tensor) -> ColumnParallelLinear:
        self.shards[f"{name}.weight"] = (0, rows)
        if linear.bias is not None:
            self.shards[f"{name}.bias"] = (0, rows)
        return ColumnParallelLinear(linear, rows, self.tp_group, self.sp)

    def _row(self, name: str, linear: nn.Linear, cols: torch.Tensor) -> RowParallelLinear:
        self.shards[f"{name}.weight"] = (1, cols)
        return RowParallelLinear(linear, cols, self.tp_group, self.sp)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token (and learned position) embeddings of this rank's part of the sequence: its CP
        chunk, and under SP its TP slice."""
        assert self.wte is not None  # the first stage's
        x = self.wte(idx)  # (B, t, C): t = T/cp, or T/cp/tp under SP
        if self.wpe is not None:
            t = x.size(1)
            start = self.cp_rank * idx.size(1) + (self.tp_rank * t if self.sp else 0)
            x = x + self.wpe(torch.arange(start, start + t, device=idx.device))
        return x

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The stage's blocks on ``x`` (the class docstring); the last stage returns the mean
        loss."""
        if self.first:
            x = self.embed(local_chunk(x, self.cp, self.cp_rank))
        for block in self.h.values():
            x = block(x)
        if not self.last:
            return x
        assert targets is not None and self.lm_head is not None and self.ln_f is not None
        targets = local_chunk(targets, self.cp, self.cp_rank)
        logits = self.lm_head(self.ln_f(x))  # (B, T/cp, V/tp): under SP the head gathers
        losses = vocab_parallel_cross_entropy(
            logits.flatten(0, 1), targets.flatten(), start=self.vocab_start, group=self.tp_group
        )
        return losses.mean()

    def is_tp_sharded(self, name: str) -> bool:
        """Whether parameter ``name`` is split over the TP group."""
        return name in self.shards

    def is_expert(self, name: str) -> bool:
        """Whether ``name`` is an expert's parameter, sharded over the ``ep`` group (ep > 1)."""
        return self.ep > 1 and is_expert_param(name)


def _linear(module: nn.Module | torch.Tensor | None) -> nn.Linear:
    """A plain linear of the model, about to be sharded."""
    assert isinstance(module, nn.Linear)
    return module


def parallelize(model: GPT, mesh: Mesh, *, sp: bool) -> StageModule:
    """This rank's stage of ``model`` with tensor parallelism applied (see module docstring).
    The model's modules are moved into the stage; do not use ``model`` afterwards."""
    return StageModule(model, mesh, sp)


def gather_full_params(stage: StageModule, mesh: Mesh) -> dict[str, torch.Tensor]:
    """The whole model's parameters, named as in the plain GPT, on every rank.

    TP shards are all-gathered over the TP group and written back at their indices, the
    experts exchanged over the ``ep`` group; the stages' dictionaries are then exchanged over the pipeline group. Meant for tests and
    for consolidating small checkpoints (it materialises the full model on every rank)."""
    tp_group, n = mesh.groups.get("tp"), mesh.size("tp")
    full: dict[str, torch.Tensor] = {}
    for name, p in stage.named_parameters():
        t = p.detach().cpu()
        if name in stage.shards and n > 1:
            dim, _ = stage.shards[name]
            flat = torch.empty((n * t.shape[0], *t.shape[1:]), dtype=t.dtype)
            dist.all_gather_single(flat, t.contiguous(), group=tp_group)
            parts = flat.view(n, *t.shape)
            idx = [torch.as_tensor(i) for i in _all_indices(stage, name, mesh)]
            shape = list(t.shape)
            shape[dim] = sum(len(i) for i in idx)
            whole = torch.empty(shape, dtype=t.dtype)
            for k in range(n):
                whole.index_copy_(dim, idx[k], parts[k])
            t = whole
        full[name] = t.clone()
    full = gather_experts(full, mesh)
    if group_size(mesh.groups.get("pp")) > 1:
        stages: list[Any] = [None] * mesh.size("pp")  # each stage's dictionary
        dist.all_gather_object(stages, full, group=mesh.groups["pp"])
        full = {k: v for part in stages for k, v in part.items()}
    return full


def _all_indices(stage: StageModule, name: str, mesh: Mesh) -> list[list[int]]:
    """The full-tensor indices held by each TP rank for ``name`` (gathered over TP)."""
    mine = stage.shards[name][1].tolist()
    out: list[Any] = [None] * mesh.size("tp")  # each TP rank's indices
    dist.all_gather_object(out, mine, group=mesh.groups["tp"])
    return out
