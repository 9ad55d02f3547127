"""Pipeline-parallel training with torch.distributed.pipelining, replicated over data-parallel
ranks: a plain script that knows nothing of megascope. Trace and diagnose it unmodified (4 CPU
ranks as 2 stages x 2 replicas, rank 1 made 1.5x slower):

    MEGASCOPE_TRACE=runs/pp torchrun --nproc-per-node 4 -m tracer.run examples/pipelining.py \
        --pp 2 --slow-rank 1
    megascope analyze runs/pp

The GPT's blocks are split into ``--pp`` stages (the first holds the embedding, the last the
head and the loss), each a ``PipelineStage`` run by a GPipe or 1F1B schedule over
``--microbatches`` microbatches; the ``world / pp`` replicas all-reduce each stage's gradients.
``--groups`` says how the script makes its process groups: ``new_group`` calls of its own
(``manual``, the default), or a DeviceMesh with its dimensions named ``("dp", "pp")`` (``mesh``)
or left unnamed (``mesh-unnamed``). The slow rank's blocks burn their extra compute, or with
``--slow-mode sleep`` sleep it (examples/slowdown.py).
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import GPT, StepTimer, arguments, loader
from slowdown import slow_down
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

VOCAB = 512


class Stage(nn.Module):
    """The part of the GPT one pipeline stage runs: the embedding on the first, the head on the
    last, an equal share of the blocks on each."""

    def __init__(self, gpt: GPT, index: int, stages: int) -> None:
        super().__init__()
        per = len(gpt.layers) // stages
        lo, hi = index * per, (index + 1) * per if index < stages - 1 else len(gpt.layers)
        self.tok_embeddings = gpt.tok_embeddings if index == 0 else None
        self.layers = nn.ModuleList(gpt.layers[lo:hi])
        last = index == stages - 1
        self.norm = gpt.norm if last else None
        self.output = gpt.output if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers:
            h = layer(h)
        if self.output is not None and self.norm is not None:
            h = self.output(self.norm(h))
        return h


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of a microbatch."""
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def process_groups(how: str, dp: int, pp: int, rank: int) -> tuple[object, object]:
    """This rank's pipeline group and data-parallel group (rank = replica * pp + stage)."""
    if how == "manual":
        mine_pp = mine_dp = None
        for d in range(dp):  # every rank makes every group, in the same order
            g = dist.new_group([d * pp + s for s in range(pp)])
            mine_pp = g if rank // pp == d else mine_pp
        for s in range(pp):
            g = dist.new_group([d * pp + s for d in range(dp)])
            mine_dp = g if rank % pp == s else mine_dp
        return mine_pp, mine_dp
    from torch.distributed.device_mesh import init_device_mesh

    names = ("dp", "pp") if how == "mesh" else None
    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=names)
    return mesh.get_group(1), mesh.get_group(0)


def main() -> None:
    p = arguments(__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=0, help="pipeline stages (default: every rank)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    p.add_argument("--groups", choices=("manual", "mesh", "mesh-unnamed"), default="manual")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pp = args.pp or world
    if world % pp or args.layers < pp:
        raise SystemExit(f"--pp {pp} must divide the {world} ranks and not exceed --layers")
    dp = world // pp
    pp_group, dp_group = process_groups(args.groups, dp, pp, rank)
    index = rank % pp
    torch.manual_seed(0)  # the same weights on every replica
    stage_mod = Stage(GPT(VOCAB, args.dim, args.layers), index, pp)
    if rank == args.slow_rank:
        slow_down(stage_mod, args.slow_factor, mode=args.slow_mode or "burn")
    stage = PipelineStage(stage_mod, index, pp, torch.device("cpu"), group=pp_group)
    kind = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    schedule = kind(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(stage_mod.parameters(), lr=1e-3)
    params = [q for q in stage_mod.parameters() if q.requires_grad]
    timer = StepTimer()
    losses: list[torch.Tensor] = []
    for batch in loader(args, VOCAB, seed=rank // pp):  # a replica's stages read one stream
        x, y = batch[:, :-1], batch[:, 1:]
        losses = []
        if index == 0:
            schedule.step(x)
        elif index == pp - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        if dp > 1:  # the replicas of a stage average its gradients
            flat = torch.cat([q.grad.flatten() for q in params])
            dist.all_reduce(flat, group=dp_group)
            flat /= dp
            offset = 0
            for q in params:
                n = q.numel()
                q.grad.copy_(flat[offset : offset + n].view_as(q))
                offset += n
        opt.step()
        opt.zero_grad(set_to_none=False)
        timer.tick()
    if index == pp - 1 and rank == world - 1:
        loss = torch.stack(losses).mean().item() if losses else float("nan")
        print(f"pipelining: dp={dp} pp={pp}, {args.steps} steps, "
              f"median step {timer.median_ms():.1f} ms, last loss {loss:.3f}")  # fmt: skip
    del schedule, stage, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
