"""Data-parallel training with DistributedDataParallel: a plain script that knows nothing of
megascope. Trace and diagnose it unmodified (4 CPU ranks, rank 2 made 1.5x slower):

    MEGASCOPE_TRACE=runs/ddp torchrun --nproc-per-node 4 -m tracer.run examples/ddp.py --slow-rank 2
    megascope analyze runs/ddp

The slow rank burns its extra time in matrix products (``--slow-mode burn``, contending for
the cores as a slow GPU's peers see it) or sleeps it (``--slow-mode sleep``). ``--accum N``
accumulates gradients over N microbatches per step under DDP's ``no_sync``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc

import torch
import torch.distributed as dist
from common import GPT, Faults, StepTimer, arguments, loader, loss_of
from slowdown import slow_down
from torch.nn.parallel import DistributedDataParallel as DDP

VOCAB = 512


def main() -> None:
    p = arguments(__doc__.splitlines()[0])
    p.add_argument(
        "--accum",
        type=int,
        default=1,
        help="microbatches per step: gradients accumulate under no_sync",
    )
    args = p.parse_args()
    args.slow_mode = args.slow_mode or "burn"  # --slow-mode (examples/common.py): burn by default
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if backend == "nccl" else None
    if device is not None:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = GPT(VOCAB, args.dim, args.layers, buffers=args.seq if args.buffers else 0).to(device)
    faults = Faults(args, rank)
    model = DDP(model)
    faults.wrap(model)  # a sleeping slow rank and a hung one
    if args.slow_mode == "burn" and rank == args.slow_rank:
        slow_down(model, args.slow_factor)  # its blocks burn their extra time
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    timer = StepTimer()
    data = loader(argparse.Namespace(**{**vars(args), "steps": args.steps * args.accum}),
                  VOCAB, seed=rank)  # fmt: skip
    batches = iter(data)
    for step in range(args.steps):
        for micro in range(args.accum):
            batch = next(batches)
            batch = batch.to(device) if device is not None else batch
            # the gradients of all but the last microbatch accumulate locally
            sync = micro == args.accum - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                loss = loss_of(model, batch)
                faults.backward(loss / args.accum, step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        timer.tick()
    if rank == 0:
        print(
            f"ddp: {args.steps} steps, median step {timer.median_ms():.1f} ms, last loss {loss.item():.3f}"
        )
    del model, opt
    gc.collect()  # before destroy: gloo's DDP can abort at exit otherwise
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
