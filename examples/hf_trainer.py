"""Hugging Face transformers' Trainer, data parallel, on a tiny GPT-2 built from its config (no
tokenizer, nothing downloaded, synthetic tokens): a plain script that knows nothing of
megascope. Trace and diagnose it unmodified (4 CPU ranks on gloo, rank 2 burning 1.5x):

    MEGASCOPE_TRACE=runs/hf torchrun --nproc-per-node 4 -m tracer.run examples/hf_trainer.py --slow-rank 2 --slow-factor 1.5
    megascope analyze runs/hf

On GPUs the same command runs on NCCL, one GPU per rank.
"""

from __future__ import annotations

import os

# Nothing reaches the network: no hub, no telemetry, no experiment trackers.
for _k, _v in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "WANDB_DISABLED": "true",
    "WANDB_MODE": "disabled",
    "DISABLE_MLFLOW_INTEGRATION": "TRUE",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_k, _v)

import tempfile  # noqa: E402

import torch  # noqa: E402
from common import Tokens, arguments  # noqa: E402
from slowdown import hang_at, slow_down  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

VOCAB = 512


class LMTokens(Tokens):
    """The shared synthetic tokens as a causal language model's inputs (GPT-2 shifts them)."""

    def __getitem__(self, i: int) -> dict:
        ids = self.data[i]
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    p = arguments(__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--accum", type=int, default=1, help="microbatches a step (gradient_accumulation_steps)"
    )
    args = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    torch.manual_seed(args.seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=args.seq + 1,
        n_embd=args.dim,
        n_layer=args.layers,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    if rank == args.slow_rank:
        # its blocks: transformer.h
        slow_down(model, args.slow_factor, mode=args.slow_mode or "burn")
    if rank == args.hang_rank:
        hang_at(model, args.hang_step)
    data = LMTokens(args.batch * args.accum * args.steps * world, args.seq, VOCAB, args.seed)
    with tempfile.TemporaryDirectory(prefix="hf_trainer_") as out:
        training = TrainingArguments(
            output_dir=out,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch,
            gradient_accumulation_steps=args.accum,
            learning_rate=1e-3,
            seed=args.seed,
            use_cpu=not cuda,
            ddp_backend="nccl" if cuda else "gloo",
            ddp_find_unused_parameters=False,
            dataloader_num_workers=0,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=training, train_dataset=data)
        result = trainer.train()
    if rank == 0:
        print(
            f"hf_trainer: {result.global_step} steps, {result.metrics['train_runtime']:.1f} s, "
            f"loss {result.training_loss:.3f}"
        )


if __name__ == "__main__":
    main()
