"""Data-parallel training with DistributedDataParallel: a plain script that knows nothing of
megascope. Trace and diagnose it unmodified (4 CPU ranks, rank 2 made 1.5x slower):

    MEGASCOPE_TRACE=runs/ddp torchrun --nproc-per-node 4 -m tracer.run examples/ddp.py --slow-rank 2
    megascope analyze runs/ddp
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from common import GPT, Faults, StepTimer, arguments, loader, loss_of
from torch.nn.parallel import DistributedDataParallel as DDP

VOCAB = 512


def main() -> None:
    args = arguments(__doc__.splitlines()[0]).parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if backend == "nccl" else None
    if device is not None:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = GPT(VOCAB, args.dim, args.layers).to(device)
    faults = Faults(args, rank)
    model = DDP(model)
    faults.wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    timer = StepTimer()
    for step, batch in enumerate(loader(args, VOCAB, seed=rank)):
        loss = loss_of(model, batch.to(device) if device is not None else batch)
        faults.backward(loss, step)
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
