"""A plain training loop through Hugging Face accelerate's Accelerator, data parallel, on the small
GPT of common.py (synthetic tokens): a plain script that knows nothing of megascope. Trace and
diagnose it unmodified (4 CPU ranks on gloo, rank 2 burning 1.5x):

    MEGASCOPE_TRACE=runs/accelerate torchrun --nproc-per-node 4 -m tracer.run examples/accelerate_loop.py --slow-rank 2 --slow-factor 1.5
    megascope analyze runs/accelerate

On GPUs the same command runs on NCCL, one GPU per rank.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing reaches the network
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from common import GPT, StepTimer, Tokens, arguments, loss_of  # noqa: E402
from slowdown import hang_at, slow_down  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

VOCAB = 512


def main() -> None:
    p = arguments(__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # init_process_group here
    rank = accelerator.process_index
    set_seed(args.seed)
    model = GPT(VOCAB, args.dim, args.layers)
    if rank == args.slow_rank:
        # its blocks: model.layers
        slow_down(model, args.slow_factor, mode=args.slow_mode or "burn")
    if rank == args.hang_rank:
        hang_at(model, args.hang_step)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = Tokens(args.batch * args.steps * accelerator.num_processes, args.seq, VOCAB, args.seed)
    loader = DataLoader(data, batch_size=args.batch, shuffle=False)
    model, opt, loader = accelerator.prepare(model, opt, loader)  # DDP, sharded data
    timer = StepTimer()
    for batch in loader:
        loss = loss_of(model, batch)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        timer.tick()
    if accelerator.is_main_process:
        print(
            f"accelerate_loop: {args.steps} steps, median step {timer.median_ms():.1f} ms, "
            f"last loss {loss.item():.3f}"
        )
    accelerator.end_training()  # destroys the process group


if __name__ == "__main__":
    main()
