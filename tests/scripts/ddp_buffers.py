"""A plain DDP script as its users write it, with a model that holds buffers (batch-norm
statistics): DDP's default ``broadcast_buffers=True`` broadcasts them at the start of every
forward. One rank (``--slow-rank``) burns ``--slow-factor`` times its forward's CPU work (the
extra after the forward returns, in the script's loop); its peers wait for it inside their
backward. Knows nothing of megascope.

    torchrun --nproc-per-node 4 -m tracer.run tests/scripts/ddp_buffers.py --slow-rank 1
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset


def forever(loader: DataLoader):
    while True:
        yield from loader


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-factor", type=float, default=1.6)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(512, 512), nn.BatchNorm1d(512), nn.ReLU()) for _ in range(6)]
    model = DDP(nn.Sequential(*layers, nn.Linear(512, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    data = TensorDataset(
        torch.randn(1024, 512, generator=g), torch.randint(0, 10, (1024,), generator=g)
    )
    batches = forever(DataLoader(data, batch_size=256))
    extra = torch.randn(256, 256, generator=g)
    for _ in range(args.steps):
        x, y = next(batches)
        began = time.thread_time()
        out = model(x)
        if rank == args.slow_rank:  # a slower device: its forward's work takes longer
            until = time.thread_time() + (args.slow_factor - 1) * (time.thread_time() - began)
            while time.thread_time() < until:
                extra @ extra
        loss = nn.functional.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    del model, opt
    gc.collect()  # before destroy: gloo's DDP can abort at exit otherwise
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
