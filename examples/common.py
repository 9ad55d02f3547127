"""What the two example scripts share: a small GPT, a synthetic token stream, and a knob that
makes one rank slow or hung the way a bad GPU or a stuck host would.

Nothing here knows megascope: these are plain PyTorch training scripts, as users write them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


def arguments(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="sequences per data-parallel rank")
    # big enough that a forward is tens of ms of work on a CPU rank: on cores shared by several
    # ranks, one of a few ms is as long as the scheduler's time slices, and reads as noise
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--slow-rank", type=int, default=-1, help="this rank computes slower")
    p.add_argument("--slow-factor", type=float, default=1.5)
    p.add_argument(
        "--slow-mode",
        choices=("burn", "sleep"),
        default=None,
        help="the slow rank computes its extra time (burn) or sleeps it (default: the script's)",
    )
    p.add_argument("--hang-rank", type=int, default=-1, help="this rank stops before a backward")
    p.add_argument("--hang-step", type=int, default=-1)
    p.add_argument(
        "--buffers",
        action="store_true",
        help="the model registers a buffer (a fixed position table): DDP broadcasts it at the "
        "start of every forward",
    )
    return p


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds its share of the heads
        q, k, v = (
            w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, 4 * dim, bias=False)
        self.w2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = FeedForward(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int = 4, buffers: int = 0) -> None:
        """``buffers``: the longest sequence of a fixed position table registered as a buffer
        (0: none), as models with fixed position encodings hold one."""
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        if buffers:
            g = torch.Generator().manual_seed(1)
            self.register_buffer("positions", 0.02 * torch.randn(buffers, dim, generator=g))
        else:
            self.positions = None
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        if self.positions is not None:
            h = h + self.positions[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


class Tokens(Dataset):
    """Random token sequences, the same on every rank for the same seed."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (n, seq + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


def loader(args: argparse.Namespace, vocab: int, seed: int) -> DataLoader:
    data = Tokens(args.batch * args.steps, args.seq, vocab, seed)
    return DataLoader(data, batch_size=args.batch, shuffle=False)


def loss_of(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


class StepTimer:
    """Wall time per training step, as a training log prints it."""

    def __init__(self) -> None:
        self.marks = [time.perf_counter()]

    def tick(self) -> None:
        self.marks.append(time.perf_counter())

    def median_ms(self, skip: int = 2) -> float:
        steps = [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)][skip:]
        return 1e3 * statistics.median(steps) if steps else float("nan")


class Faults:
    """A slow rank and a hung rank, as a bad GPU or a stuck host would make them.

    The slow rank's forward and backward take ``factor`` times as long. The extra time is
    slept at their end, in proportion to the CPU time they took, which holds none of the
    waiting for other ranks (a delay in proportion to waiting would feed on itself), scaled by
    how much longer than its CPU time a layer takes on this machine (several ranks sharing a
    few cores each wait for a core).
    """

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        # a script that burns its slow rank's time (examples/slowdown.py) sleeps none of it
        sleeps = (getattr(args, "slow_mode", None) or "sleep") == "sleep"
        self.factor = args.slow_factor if rank == args.slow_rank and sleeps else 1.0
        self.hang = rank == args.hang_rank
        self.hang_step = args.hang_step
        self._wall = self._cpu = 1e-9  # of the layers: how long a CPU second takes here

    def _scale(self) -> float:
        return max(1.0, self._wall / self._cpu)

    def wrap(self, model: nn.Module) -> None:
        """After the model is parallelized (so that these hooks run inside the others)."""
        if self.factor == 1.0:
            return

        def layer_before(module: nn.Module, args: tuple) -> None:
            module._slow_t = (time.perf_counter(), time.thread_time())

        def layer_after(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            wall, cpu = module._slow_t
            self._wall += time.perf_counter() - wall
            self._cpu += time.thread_time() - cpu

        def before(module: nn.Module, args: tuple) -> None:
            module._slow_cpu = time.thread_time()

        def after(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            cpu = time.thread_time() - module._slow_cpu
            time.sleep((self.factor - 1.0) * cpu * self._scale())

        for module in model.modules():
            if isinstance(module, (Attention, FeedForward)):
                module.register_forward_pre_hook(layer_before)
                module.register_forward_hook(layer_after)
        model.register_forward_pre_hook(before)
        model.register_forward_hook(after)

    def backward(self, loss: torch.Tensor, step: int) -> None:
        if self.hang and step == self.hang_step:
            while True:  # stuck: the others wait for this rank in their next collective
                time.sleep(1.0)
        cpu = time.thread_time()  # on CPU the backward runs on this thread
        loss.backward()
        if self.factor != 1.0:
            time.sleep((self.factor - 1.0) * (time.thread_time() - cpu) * self._scale())
