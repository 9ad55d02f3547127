"""Make one rank's model slower by a given factor, the way a slow GPU would: its transformer
blocks burn extra real compute (matrix multiplications) in their forward and in their backward,
so that each takes about ``factor`` times as long as on its peers.

Plain PyTorch; nothing here knows megascope or any training framework. Call it on the model
before or after wrapping it (DDP, a framework's own wrapper):

    from slowdown import slow_down
    if rank == args.slow_rank:
        slow_down(model, args.slow_factor)

How it is calibrated: each block's own forward is timed, and its backward from the gradient
reaching its output to the gradient reaching its input, and so is the burning (how long one
multiplication of a small square matrix takes on the block's device). Each forward then burns
``(factor - 1)`` times the median of the block's recent forwards in multiplications, each
backward the same share of its backward; fractions of a multiplication carry over to the next
call. On a CPU with one intra-op thread (torchrun's default) the clock is the calling thread's
CPU time, so the extra work is ``factor - 1`` times the block's own work whatever else runs on
the machine: where ranks share cores, their waits for a core are not read as work. On CUDA
timing synchronizes the device, so only the first calls are timed; from then on each call burns a
fixed amount of work, as a slower chip would take.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Iterable

import torch
from torch import nn

CALIBRATION_CALLS = 8  # on CUDA: calls of a block timed (the first two are warm-ups)
WINDOW = 16  # recent timings whose median sets the work burnt


def find_blocks(model: nn.Module, blocks: str | Iterable[nn.Module] | None = None) -> list:
    """The model's repeated blocks: the modules of a class named ``blocks``, the modules given,
    or (None) the children of the first ``nn.ModuleList`` in the model."""
    if blocks is None:
        for m in model.modules():
            if isinstance(m, nn.ModuleList) and len(m) > 0:
                return list(m)
        raise ValueError("slow_down: the model holds no nn.ModuleList; name the block class")
    if isinstance(blocks, str):
        found = [m for m in model.modules() if type(m).__name__ == blocks]
        if not found:
            raise ValueError(f"slow_down: no module of class {blocks!r} in the model")
        return found
    return list(blocks)


class _Clock:
    """Time on one device: CUDA synchronized wall time, the thread's CPU time on a CPU with one
    intra-op thread, else wall time."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.cpu_time = not self.cuda and torch.get_num_threads() == 1

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.thread_time() if self.cpu_time else time.perf_counter()


class _Slow:
    """The extra work of one block, forward and backward, and what it was calibrated on."""

    def __init__(self, factor: float, mode: str = "burn") -> None:
        self.extra = factor - 1.0
        self.sleeps = mode == "sleep"  # the extra time slept, as a host waits on a slow device
        self.clock: _Clock | None = None
        self.a = self.out = None  # the matrix multiplied
        # seconds per multiplication, in the forward and in the backward: where ranks share
        # cores, the peers are busy in the forward and may be waiting by the backward
        self.unit = {"fwd": deque(maxlen=WINDOW), "bwd": deque(maxlen=WINDOW)}
        self.times = {"fwd": deque(maxlen=WINDOW), "bwd": deque(maxlen=WINDOW)}
        self.credit = {"fwd": 0.0, "bwd": 0.0}
        self.calls = 0
        self.t0 = 0.0
        self.grad_out_at: float | None = None  # when the gradient reached the block's output

    def setup(self, device: torch.device) -> None:
        n = 1024 if device.type == "cuda" else 128
        g = torch.Generator().manual_seed(0)
        self.a = (torch.randn(n, n, generator=g) / n**0.5).to(device)
        self.out = torch.empty_like(self.a)
        self.clock = _Clock(device)
        if self.sleeps:  # the block's wall time: a sleep holds no core, a wait for one is time
            self.clock.cpu_time = False
        self.burn(3, None)
        for kind in ("fwd", "bwd"):
            self.burn(10, kind)

    def timing(self) -> bool:
        """Whether this call is timed: always on a CPU, the first calls on CUDA."""
        return self.calls > 2 and (not self.clock.cuda or self.calls <= CALIBRATION_CALLS)

    def burn(self, n: int, timed: str | None) -> None:
        """``n`` multiplications, timed into the unit of kind ``timed``."""
        if n <= 0:
            return
        t0 = self.clock() if timed else 0.0
        with torch.no_grad():
            for _ in range(n):
                torch.mm(self.a, self.a, out=self.out)
        if timed:
            self.unit[timed].append((self.clock() - t0) / n)

    def burn_share(self, kind: str) -> None:
        """Burn ``extra`` times the block's recent median, fractions carried over."""
        samples = self.times[kind]
        if not samples and kind == "bwd" and self.times["fwd"]:
            samples = [2 * s for s in self.times["fwd"]]  # no backward timed yet: about 2x
        if not samples:
            return
        if self.sleeps:
            time.sleep(self.extra * statistics.median(samples))
            return
        unit = max(statistics.median(self.unit[kind]), 1e-7)
        credit = self.credit[kind] + self.extra * statistics.median(samples) / unit
        whole = int(credit)
        self.credit[kind] = credit - whole
        self.burn(whole, kind if self.timing() else None)


class _BurnBackward(torch.autograd.Function):
    """Identity whose backward burns the block's share of extra backward work."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, slow: _Slow, timing: bool) -> torch.Tensor:
        ctx.slow, ctx.timing = slow, timing
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        slow = ctx.slow
        slow.burn_share("bwd")
        if ctx.timing:
            slow.grad_out_at = slow.clock()
        return grad, None, None


def _first_tensor(value):
    """The first tensor of a block's input or output, and how to put a replacement back."""
    if isinstance(value, torch.Tensor):
        return value, lambda t: t
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0], lambda t: type(value)([t, *value[1:]])
    return None, None


def _install(block: nn.Module, slow: _Slow) -> None:
    def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
        x, _ = _first_tensor(args[0] if args else kwargs.get("hidden_states", kwargs.get("x")))
        if slow.clock is None:
            slow.setup(x.device if x is not None else next(module.parameters()).device)
        slow.calls += 1
        if not slow.timing():
            return
        if x is not None and x.requires_grad and torch.is_grad_enabled():

            def grad_in(grad: torch.Tensor) -> None:
                if slow.grad_out_at is not None:
                    slow.times["bwd"].append(slow.clock() - slow.grad_out_at)
                    slow.grad_out_at = None

            x.register_hook(grad_in)
        slow.t0 = slow.clock()

    def after(module: nn.Module, args: tuple, kwargs: dict, out):
        timing = slow.timing()
        if timing:
            slow.times["fwd"].append(slow.clock() - slow.t0)
        slow.burn_share("fwd")
        y, rebuild = _first_tensor(out)
        if y is None or not y.requires_grad:
            return None
        return rebuild(_BurnBackward.apply(y, slow, timing))

    block.register_forward_pre_hook(before, with_kwargs=True)
    block.register_forward_hook(after, with_kwargs=True)


def slow_down(
    model: nn.Module,
    factor: float,
    blocks: str | Iterable[nn.Module] | None = None,
    mode: str = "burn",
) -> list:
    """Make ``model``'s blocks take about ``factor`` times as long, forward and backward:
    ``mode`` ``burn`` computes the extra time, ``sleep`` sleeps it (timed on the wall clock),
    as a host that waits on a slow device, disk or link. Returns the blocks slowed. A factor
    of 1 or less changes nothing."""
    if factor <= 1.0:
        return []
    found = find_blocks(model, blocks)
    for block in found:
        _install(block, _Slow(factor, mode))
    return found


def hang_at(model: nn.Module, step: int) -> None:
    """Stop for good at the start of the model's ``step``-th forward (counted from 0, one per
    step), as a stuck host would: the other ranks wait for it in their next collective."""
    calls = [0]

    def before(module: nn.Module, args: tuple) -> None:
        calls[0] += 1
        if calls[0] == step + 1:
            while True:
                time.sleep(1.0)

    model.register_forward_pre_hook(before)


if __name__ == "__main__":  # a quick look: the forward and backward of a slowed model
    import sys

    from common import GPT

    factor = float(sys.argv[1]) if len(sys.argv) > 1 else 1.5
    torch.set_num_threads(1)

    def timed(model: nn.Module) -> tuple[float, float]:
        tokens = torch.randint(0, 512, (8, 64))
        fwd, bwd = [], []
        for _ in range(15):
            t0 = time.thread_time()
            loss = model(tokens).float().mean()
            t1 = time.thread_time()
            loss.backward()
            fwd.append(t1 - t0)
            bwd.append(time.thread_time() - t1)
        return statistics.median(fwd[8:]), statistics.median(bwd[8:])

    torch.manual_seed(0)
    base = timed(GPT(512, 128, 2))
    slowed = GPT(512, 128, 2)
    slow_down(slowed, factor)
    slow = timed(slowed)
    print(f"forward x{slow[0] / base[0]:.2f}, backward x{slow[1] / base[1]:.2f} (whole model)")
