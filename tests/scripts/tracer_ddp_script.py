"""A plain DDP training script that knows nothing of megascope (the tracer tests run it).

Launched by torchrun (or any launcher setting RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT). Each
step: DDP forward/backward on a tiny model, an optimizer step, plus explicit collectives (an
all_reduce of the loss, a broadcast). ``--api`` additionally marks steps and spans through the
tracer API (only when a tracer is attached, e.g. by MEGASCOPE_TRACE); ``--hang-rank R
--hang-step S`` makes rank R sleep for good before the all_reduce of step S (or, with
``--hang-seconds N``, for N seconds and then die with status 1); ``--progress
FILE`` writes the step each rank reached (FILE.RANK) so a test can tell how far it got.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from torch import nn


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--api", action="store_true")
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-step", type=int, default=-1)
    p.add_argument("--hang-seconds", type=float, default=0.0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--progress", default="")
    return p.parse_args()


def main() -> None:
    args = parse()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tr = None
    if args.api:
        import tracer

        tr = tracer
    data = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    for step in range(args.steps):
        if tr is not None:
            tr.step(step)
        if args.progress:  # atomically: a rank killed mid-write must not leave it empty
            path = f"{args.progress}.{rank}"
            with open(f"{path}.tmp", "w") as f:
                f.write(str(step))
            os.replace(f"{path}.tmp", path)
        with tr.span("forward", microbatch=0) if tr else _null():
            loss = model(data).pow(2).mean()
        with tr.span("backward", microbatch=0) if tr else _null():
            loss.backward()
        with tr.span("optimizer") if tr else _null():
            opt.step()
            opt.zero_grad()
        total = loss.detach().clone()
        if rank == args.hang_rank and step == args.hang_step:
            if args.hang_seconds:  # a hang that ends in a crash
                time.sleep(args.hang_seconds)
                os._exit(1)
            while True:  # the others wait in the all_reduce below
                time.sleep(1.0)
        dist.all_reduce(total)
        flag = torch.tensor([step], dtype=torch.int64)
        dist.broadcast(flag, src=0)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    del model, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print("done", os.environ.get("MEGASCOPE_TRACE", ""))


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


if __name__ == "__main__":
    main()
