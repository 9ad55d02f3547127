"""PyTorch Lightning's Trainer with the DDP strategy, on the small GPT of common.py as a
LightningModule (synthetic tokens): a plain script that knows nothing of megascope. Trace and
diagnose it unmodified (4 CPU ranks on gloo, rank 2 burning 1.5x):

    MEGASCOPE_TRACE=runs/lightning torchrun --nproc-per-node 4 -m tracer.run examples/lightning_ddp.py --slow-rank 2 --slow-factor 1.5
    megascope analyze runs/lightning

Lightning finds torchrun's environment and runs one process per rank as launched; on GPUs the
same command runs on NCCL, one GPU per rank.
"""

from __future__ import annotations

import os
import tempfile

import lightning as L
import torch
from common import GPT, Tokens, arguments, loss_of
from slowdown import hang_at, slow_down
from torch.utils.data import DataLoader

VOCAB = 512


class LitGPT(L.LightningModule):
    def __init__(self, args) -> None:
        super().__init__()
        self.model = GPT(VOCAB, args.dim, args.layers)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return loss_of(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    p = arguments(__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    cuda = torch.cuda.is_available()
    L.seed_everything(args.seed, verbose=False)
    module = LitGPT(args)
    if rank == args.slow_rank:
        # its blocks: model.layers
        slow_down(module.model, args.slow_factor, mode=args.slow_mode or "burn")
    if rank == args.hang_rank:
        hang_at(module.model, args.hang_step)
    data = Tokens(args.batch * args.steps * world, args.seq, VOCAB, args.seed)
    loader = DataLoader(data, batch_size=args.batch, shuffle=False)
    with tempfile.TemporaryDirectory(prefix="lightning_") as out:
        trainer = L.Trainer(
            accelerator="gpu" if cuda else "cpu",
            devices=local,
            num_nodes=world // local,
            strategy="ddp",
            max_steps=args.steps,
            default_root_dir=out,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        )
        trainer.fit(module, loader)
    if trainer.global_rank == 0:
        loss = trainer.callback_metrics.get("train_loss")
        print(
            f"lightning_ddp: {trainer.global_step} steps" + (f", loss {loss:.3f}" if loss else "")
        )


if __name__ == "__main__":
    main()
