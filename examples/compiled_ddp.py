"""A compiled data-parallel model, ``torch.compile(DDP(model))``: a plain script that knows nothing
of megascope. Trace and diagnose it unmodified (4 CPU ranks, inductor, rank 2 made 1.5x slower
once the model is compiled):

    MEGASCOPE_TRACE=runs/compiled torchrun --nproc-per-node 4 -m tracer.run \\
        examples/compiled_ddp.py --slow-rank 2
    megascope analyze runs/compiled

The compiler splits the model's graph at DDP's bucket boundaries, so that each bucket's
all_reduce still overlaps the backward. The first steps compile (seconds each); the slow rank is
slowed from step ``--slow-from`` on (``--slow-mode burn``: it computes matrix products for the
extra time, ``sleep``: it sleeps it). Its extra time is ``factor - 1`` times its own recent
forward and backward (the median CPU time of the last steps), spent after its forward, outside
the compiled code, so its peers wait for it in their backward's all-reduces.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections import deque

import torch
import torch.distributed as dist
from common import GPT, StepTimer, arguments, loader, loss_of
from torch.nn.parallel import DistributedDataParallel as DDP

VOCAB = 512


class Slowdown:
    """The slow rank's extra time: ``factor - 1`` times the median of its recent forward plus
    backward CPU time (how long a CPU second takes here scales a sleep, as in common.Faults)."""

    def __init__(self, factor: float, mode: str) -> None:
        self.extra = max(0.0, factor - 1.0)
        self.mode = mode
        self.cpu: deque[float] = deque(maxlen=8)
        self.wall: deque[float] = deque(maxlen=8)
        g = torch.Generator().manual_seed(0)
        self.a = torch.randn(128, 128, generator=g) / 128**0.5
        self.out = torch.empty_like(self.a)
        self.credit = 0.0

    def measured(self, cpu: float, wall: float) -> None:
        """One step's forward and backward: ``cpu`` s of this thread, ``wall`` s elapsed."""
        self.cpu.append(cpu)
        self.wall.append(wall)

    def spend(self) -> None:
        """Burn or sleep the extra time of one step."""
        if not self.extra or len(self.cpu) < 2:
            return
        cpu = statistics.median(self.cpu)
        if self.mode == "sleep":
            scale = max(1.0, statistics.median(self.wall) / cpu)
            time.sleep(self.extra * cpu * scale)
            return
        target = time.thread_time() + self.extra * cpu + self.credit
        with torch.no_grad():
            while time.thread_time() < target:
                torch.mm(self.a, self.a, out=self.out)
        self.credit = min(0.0, target - time.thread_time())


def main() -> None:
    p = arguments(__doc__.splitlines()[0])
    p.add_argument(
        "--slow-from", type=int, default=4, help="the slow rank is slowed from this step on"
    )
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(GPT(VOCAB, args.dim, args.layers))
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # examples/common.py's --slow-mode; this script burns unless told to sleep
    slow = Slowdown(args.slow_factor if rank == args.slow_rank else 1.0, args.slow_mode or "burn")
    timer = StepTimer()
    for step, batch in enumerate(loader(args, VOCAB, seed=rank)):
        cpu, wall = time.thread_time(), time.perf_counter()
        loss = loss_of(compiled, batch)
        fwd_cpu, fwd_wall = time.thread_time() - cpu, time.perf_counter() - wall
        if step >= args.slow_from:
            slow.spend()
        cpu, wall = time.thread_time(), time.perf_counter()
        loss.backward()
        slow.measured(fwd_cpu + time.thread_time() - cpu, fwd_wall + time.perf_counter() - wall)
        opt.step()
        opt.zero_grad(set_to_none=True)
        timer.tick()
    if rank == 0:
        from torch._dynamo.utils import counters

        breaks = sum(counters["graph_break"].values())
        print(
            f"compiled_ddp: {args.steps} steps, median step {timer.median_ms(skip=args.slow_from):.1f} "
            f"ms, last loss {loss.item():.3f}, graph breaks {breaks}"
        )
    del compiled, model, opt
    gc.collect()  # before destroy: gloo's DDP can abort at exit otherwise
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
