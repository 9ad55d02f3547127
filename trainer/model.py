"""A GPT decoder in one readable file, with no parallel code in it.

Pre-norm transformer blocks (LayerNorm or RMSNorm), rotary or learned positions, causal
attention through ``F.scaled_dot_product_attention`` (which picks flash or memory-efficient
kernels on a GPU), an optional sliding window, a GELU MLP and, optionally, the *parallel block*
of GPT-J/PaLM that MegaScale uses: attention and MLP read the same normalized input and their
outputs are added to the residual together, ``x + attn(ln(x)) + mlp(ln(x))``, so the two can
overlap. With ``cfg.experts > 0`` every block's MLP is a mixture of experts
(``trainer/moe.py``: a router, top-k routing, dropless experts, a load-balancing loss); this
model, holding all the experts, is the reference for expert parallelism.

Shapes: B batch, T sequence, C = d_model, H heads, D = head_dim, V vocabulary, F = MLP size.
Parallelism is applied from outside (``trainer/parallel/apply.py``) by swapping the linear
layers for tensor-parallel ones; for that the attention derives its head count from the width
of the projection it is given (``c_attn``'s output / 3 / D) rather than from the config.
Context parallelism sets the attention's ``context`` hook, which exchanges a chunk of the
sequence for a share of the heads before the attention core and back after it.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig
from trainer.moe import MoE


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The block's norm: RMSNorm, or LayerNorm (with bias per the config)."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=1e-5)
    return nn.LayerNorm(cfg.d_model, bias=cfg.bias)


class Rotary(nn.Module):
    """Rotary position embedding: rotates each (even, odd) half-pair of q and k by an angle
    proportional to the position, so that q·k depends only on the relative distance."""

    cos: torch.Tensor  # buffers, (T, D/2)
    sin: torch.Tensor

    def __init__(self, head_dim: int, seq_len: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (T, D/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (B, H, T, D) with each pair rotated by its position's angle."""
        # x: (B, H, T, D); the first and second halves of D form the rotated pairs
        T = x.size(-2)
        cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)  # (T, D/2)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def attention_mask(T: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Boolean (T, T) mask, True where query i may attend key j: j <= i and i - j < window.
    None when there is no window (then SDPA's ``is_causal`` path is used)."""
    if window is None or window >= T:
        return None
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    return (j <= i) & (i - j < window)


class ContextHook(Protocol):
    """What context parallelism installs on an attention (trainer/parallel/context.py)."""

    def to_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """(B, T/cp, 3*H*D) -> (B, T, 3*(H/cp)*D): the whole sequence, a share of the heads."""
        ...

    def to_sequence(self, y: torch.Tensor) -> torch.Tensor:
        """(B, T, (H/cp)*D) -> (B, T/cp, H*D): back to this rank's chunk of the sequence."""
        ...


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention, with rotary positions and a sliding window where the config
    asks for them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.sliding_window = cfg.sliding_window
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)  # q, k, v
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.rotary = Rotary(cfg.head_dim, cfg.seq_len) if cfg.pos == "rope" else None
        # Context parallelism installs an object with to_heads(qkv) and to_sequence(y) here
        # (trainer/parallel/context.py): the sequence arrives split, attention sees all of it.
        self.context: ContextHook | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        qkv = self.c_attn(x)  # (B, T, 3*H*D); H = this module's heads (fewer under TP)
        if self.context is not None:  # (B, T/cp, 3*H*D) -> (B, T, 3*(H/cp)*D)
            qkv = self.context.to_heads(qkv)
        B, T, three_hd = qkv.shape
        H = three_hd // (3 * self.head_dim)
        q, k, v = qkv.view(B, T, 3, H, self.head_dim).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, D)
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        mask = attention_mask(T, self.sliding_window, x.device)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        y = y.transpose(1, 2).reshape(B, T, H * self.head_dim)  # (B, T, H*D)
        if self.context is not None:  # (B, T, (H/cp)*D) -> (B, T/cp, H*D)
            y = self.context.to_sequence(y)
        return self.c_proj(y)  # (B, T, C)


class MLP(nn.Module):
    """Two linear layers with a GELU between: C -> F -> C."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, cfg.ff, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.ff, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        return self.c_proj(F.gelu(self.c_fc(x)))  # (B, T, C) -> (B, T, F) -> (B, T, C)


class Block(nn.Module):
    """Pre-norm block: ``x + attn(ln1(x))`` then ``+ mlp(ln2(.))``; or, as a parallel block,
    ``x + attn(ln1(x)) + mlp(ln1(x))`` with a single norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.parallel = cfg.parallel_block
        self.ln_1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2: nn.Module | None = None if cfg.parallel_block else make_norm(cfg)
        self.mlp = MoE(cfg, MLP) if cfg.experts > 0 else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        """(B, T, C) -> (B, T, C)."""
        if self.parallel:
            h = self.ln_1(x)
            return x + self.attn(h) + self.mlp(h)
        assert self.ln_2 is not None  # a sequential block has its second norm
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token (and learned position) embedding, ``n_layer`` blocks, final norm, output head.

    ``forward(idx)`` gives logits (B, T, V); ``forward(idx, targets)`` the mean cross-entropy.
    The pieces ``embed``, ``h`` and ``head`` are public so that a pipeline stage can run
    only its share of them.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.pos == "learned" else None
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2L), zero
        biases. Draws from torch's global generator: seed it for a reproducible model."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() < 2:
                nn.init.ones_(p)
            elif name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.cfg.n_layer))
            else:
                nn.init.normal_(p, std=0.02)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Tokens (B, T) -> embeddings (B, T, C), positions added when learned."""
        x = self.wte(idx)  # (B, T) -> (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.size(1), device=idx.device))
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and output head: (B, T, C) -> logits (B, T, V)."""
        return self.lm_head(self.ln_f(x))  # (B, T, C) -> (B, T, V)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V); with ``targets``, the mean cross-entropy instead."""
        x = self.embed(idx)
        for block in self.h:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def count_params(cfg: ModelConfig) -> int:
    """Parameters of the whole model, embeddings included (counted from the config, without
    building the model; tests check it against ``GPT(cfg).parameters()``). A mixture of
    experts counts every expert and the router."""
    d, b = cfg.d_model, int(cfg.bias)
    norm = d * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    attn = (3 * d * d + 3 * d * b) + (d * d + d * b)
    mlp = _mlp_params(cfg) * max(1, cfg.experts) + d * cfg.experts  # experts, router
    block = attn + mlp + norm * (1 if cfg.parallel_block else 2)
    embed = cfg.vocab_size * d + (cfg.seq_len * d if cfg.pos == "learned" else 0)
    return embed + cfg.n_layer * block + norm + cfg.vocab_size * d


def _mlp_params(cfg: ModelConfig) -> int:
    """Parameters of one MLP (or one expert)."""
    d, ff, b = cfg.d_model, cfg.ff, int(cfg.bias)
    return (d * ff + ff * b) + (ff * d + d * b)


def flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs per token (forward + backward), as in the PaLM paper's appendix B:
    ``6 * N + 12 * L * C * T_eff``.

    ``N`` counts the parameters that take part in matrix multiplies: everything but the
    embedding tables (a lookup costs no FLOPs), the output head included. The second term is
    attention's ``q @ k^T`` and ``att @ v`` (2 x 2 FLOPs per multiply-add, x3 for the
    backward), over a context of ``T_eff = min(seq_len, sliding_window)`` keys. Causal masking
    is not discounted, the usual convention for MFU. With a mixture of experts a token runs
    through ``top_k`` experts, so the other experts' parameters are left out of ``N`` (the
    router's are in).
    """
    n = count_params(cfg) - cfg.vocab_size * cfg.d_model
    if cfg.experts:
        n -= cfg.n_layer * (cfg.experts - cfg.top_k) * _mlp_params(cfg)
    if cfg.pos == "learned":
        n -= cfg.seq_len * cfg.d_model
    t_eff = min(cfg.seq_len, cfg.sliding_window or cfg.seq_len)
    return 6 * n + 12 * cfg.n_layer * cfg.d_model * t_eff
