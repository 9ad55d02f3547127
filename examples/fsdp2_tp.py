"""FSDP2 with tensor parallelism on a 2D DeviceMesh, in torchtitan's layout: a plain script that
knows nothing of megascope. Trace and diagnose it unmodified (4 CPU ranks as dp2 x tp2, rank 1
made 1.5x slower; ``--tp 1`` is FSDP2 alone):

    MEGASCOPE_TRACE=runs/fsdp torchrun --nproc-per-node 4 -m tracer.run examples/fsdp2_tp.py --tp 2 --slow-rank 1
    megascope analyze runs/fsdp
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from common import GPT, Faults, StepTimer, arguments, loader, loss_of
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

VOCAB = 512


def tensor_parallel(block: torch.nn.Module, tp_mesh) -> None:
    """Megatron's split: column-wise in, row-wise out, one all-reduce per sublayer."""
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    parallelize_module(block, tp_mesh, plan)


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if device_type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if args.tp > 1:
        mesh = init_device_mesh(
            device_type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp")
        )
        dp_mesh = mesh["dp"]
    else:
        dp_mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = GPT(VOCAB, args.dim, args.layers)
    faults = Faults(args, rank)
    for block in model.layers:
        if args.tp > 1:
            tensor_parallel(block, mesh["tp"])
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    faults.wrap(model)
    model.to(device_type)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # tensor-parallel peers read the same batch: the data follows the dp coordinate
    timer = StepTimer()
    for step, batch in enumerate(loader(args, VOCAB, seed=dp_mesh.get_local_rank())):
        loss = loss_of(model, batch.to(device_type))
        faults.backward(loss, step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        timer.tick()
    if rank == 0:
        print(
            f"fsdp2 tp{args.tp}: {args.steps} steps, median step {timer.median_ms():.1f} ms, last loss {loss.item():.3f}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
