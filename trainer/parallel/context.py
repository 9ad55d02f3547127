"""Context parallelism, DeepSpeed Ulysses style: the sequence split over the CP group, and
attention computed over the whole sequence after an all-to-all that trades sequence for heads.

**The split.** Every rank of a CP group receives the same sequences (the data is a function of
the DP rank only) and keeps one contiguous chunk of them: CP rank ``c`` holds the tokens
``[c * T/cp, (c + 1) * T/cp)`` of the inputs and of the targets (:func:`local_chunk`). Outside
attention every layer works token by token, so it runs on the chunk unchanged: embeddings,
norms, the MLP, the output head, the cross-entropy. Learned positions are looked up at the
chunk's absolute positions (``StageModule.embed`` adds ``c * T/cp``, and under sequence
parallelism the TP rank's offset inside the chunk).

**Attention.** :class:`Ulysses` is installed on every attention module of the stage
(``attn.context``). After the q, k, v projection each rank holds (B, T/cp, 3 x H x D) for
the H heads of its TP rank; :meth:`Ulysses.to_heads` is one ``all_to_all_single`` over the CP
group that sends head group ``j`` (``H/cp`` heads) to CP rank ``j`` and receives the other
chunks of the sequence for its own head group: (B, T, 3 x H/cp x D). Rotary positions, the
causal (or sliding-window) mask and ``scaled_dot_product_attention`` then see the full
sequence, exactly as without CP; rotary needs no offset since it runs after the exchange.
:meth:`Ulysses.to_sequence` is the inverse all-to-all on the attention output, (B, T, H/cp x D)
-> (B, T/cp, H x D), before the output projection. Both use the differentiable
``torch.distributed.nn.functional.all_to_all_single``, whose backward is the opposite
all-to-all; it calls ``torch.distributed.all_to_all_single`` by attribute lookup, so the
tracer's wrapper records every exchange (forward and backward) in the ``cp`` group. Under
``torch.compile`` the two exchanges run eager (a graph break on each side).

**Loss and gradients.** Each CP rank's loss is the mean over its chunk's tokens; the chunks
are of equal size, so the mean of the CP ranks' losses is the mean over the whole sequence
(the engine averages the reported loss over ``cp`` as over ``dp``; a replica given more rows
than the others by ``seq_skew`` has them on every CP rank, and its loss weight, the same on
each of them, weights it over ``dp`` only). Every CP rank holds the same parameters, and the
gradients summed over the CP group are ``cp`` times the gradient of the whole-sequence mean
(the all-to-all's backward carries each rank's share back to the ranks whose keys and values
it used). So the gradients are averaged over ``dp x cp``, as Megatron folds CP into the
data-parallel gradient group: ``parallel.data_parallel`` divides by ``dp * cp``,
reduce-scatters over DP as before, then all-reduces the reduced slice over CP.
The sharded optimizer stays sharded over DP only (CP ranks hold identical masters and take
identical steps), which keeps the checkpoint layout, the norms and the ``dp`` groups as they
are, at the cost of optimizer memory that is not divided by ``cp``.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_to_all_single

from trainer.model import CausalSelfAttention
from trainer.parallel.tensor import group_size

# The differentiable all-to-all warns on every call that it is deprecated in favour of the
# functional collectives, which bypass torch.distributed's Python API (and the tracer).
warnings.filterwarnings(
    "ignore",
    message=r"torch\.distributed\.nn\.functional\.all_to_all_single is deprecated",
    category=FutureWarning,
)


def local_chunk(tokens: torch.Tensor, cp: int, index: int) -> torch.Tensor:
    """CP rank ``index``'s contiguous share of ``tokens`` (..., T) along the last dimension."""
    if cp == 1:
        return tokens
    n = tokens.size(-1) // cp
    return tokens[..., index * n : (index + 1) * n]


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    """All-to-all along dim 0 (split into ``cp`` equal parts, part ``j`` to CP rank ``j``)."""
    x = x.contiguous()
    return all_to_all_single(torch.empty_like(x), x, group=group)


class Ulysses:
    """The two all-to-alls of Ulysses attention over one CP group (see the module docstring).
    Heads are laid out as the q, k, v projection lays them out: ``[q heads | k heads | v
    heads]``, each ``H x D`` wide; CP rank ``j`` takes heads ``[j * H/cp, (j + 1) * H/cp)``."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group, self.cp = group, group_size(group)

    @torch.compiler.disable
    def to_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """(B, T/cp, 3*H*D) -> (B, T, 3*(H/cp)*D): the whole sequence, this rank's heads."""
        B, t, width = qkv.shape
        n = self.cp
        parts = qkv.view(B, t, 3, n, width // (3 * n)).permute(3, 1, 0, 2, 4)  # (cp, t, B, 3, hD)
        out = _exchange(parts, self.group)  # (cp, t, B, 3, hD): dim 0 is now the source chunk
        return out.reshape(n * t, B, width // n).transpose(0, 1)

    @torch.compiler.disable
    def to_sequence(self, y: torch.Tensor) -> torch.Tensor:
        """(B, T, (H/cp)*D) -> (B, T/cp, H*D): this rank's chunk, every head of the TP rank."""
        B, T, hd = y.shape
        n = self.cp
        parts = y.view(B, n, T // n, hd).permute(1, 2, 0, 3)  # (cp, t, B, hD): dim 0: chunk
        out = _exchange(parts, self.group)  # (cp, t, B, hD): dim 0 is now the head group
        return out.permute(2, 1, 0, 3).reshape(B, T // n, n * hd)


def apply_context_parallel(blocks: nn.ModuleDict, group: dist.ProcessGroup | None) -> None:
    """Install :class:`Ulysses` on the attention of every block (nothing for a group of one)."""
    if group_size(group) == 1:
        return
    ulysses = Ulysses(group)
    for block in blocks.values():
        attn = block.get_submodule("attn")
        assert isinstance(attn, CausalSelfAttention)
        attn.context = ulysses
