"""MFU of the ~1B GPT preset on one GPU: tokens/s, achieved TFLOP/s, peak and MFU.

    python bench/mfu.py [--batch 4] [--steps 10] [--warmup 3] [--compile] [--layers N]

Measures, side by side in one process and on the same batch:

* ``plain``  — ``trainer.model.GPT`` with bf16 autocast, flash attention forced through
  ``sdpa_kernel(FLASH_ATTENTION)`` and a fused AdamW: the ceiling of this model on this GPU;
* ``engine`` — the trainer's own :class:`trainer.engine.Engine` on a world of one rank (the
  code a ``megascope train --device cuda --dtype bf16`` run executes, minus communication);
* ``plain+compile`` with ``--compile`` (``torch.compile`` of the model).

Each variant runs ``--warmup`` untimed steps, then ``--steps`` steps between two
``torch.cuda.synchronize()`` calls. Achieved FLOP/s = ``flops_per_token`` (PaLM's 6N + 12LCT
count, :func:`trainer.model.flops_per_token`) x tokens/s; MFU = achieved / the device's dense
bf16 peak (:data:`trainer.progress.PEAK_TFLOPS`, by device name; unknown devices print
``n/a``). The last line gives the engine's throughput as a ratio of the plain model's.

On a machine without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import sys
import time
from collections.abc import Callable

import torch


def _flash() -> contextlib.AbstractContextManager:
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    except ImportError:  # older torch
        return contextlib.nullcontext()


def _time(step: Callable[[], None], warmup: int, steps: int) -> float:
    """Seconds per step, measured between device synchronizations."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def plain_step(cfg, batch: torch.Tensor, compile_: bool) -> Callable[[], None]:
    """One optimizer step of the bare model (bf16 autocast, flash SDPA, fused AdamW)."""
    from trainer.model import GPT

    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), fused=True)
    fwd = torch.compile(model) if compile_ else model
    x, y = batch[:, :-1], batch[:, 1:]

    def step() -> None:
        with _flash(), torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def engine_step(cfg, batch: torch.Tensor) -> Callable[[], None]:
    """One ``Engine.train_step`` on a world of one rank (no process group needed)."""
    from trainer.config import ParallelConfig, TrainConfig
    from trainer.engine import Engine
    from trainer.parallel.mesh import Mesh

    train = TrainConfig(
        steps=1000, microbatches=1, micro_batch_size=batch.size(0), device="cuda", dtype="bf16"
    )
    engine = Engine(cfg, train, Mesh(ParallelConfig()))
    mb = batch.unsqueeze(0)  # (microbatches=1, B, T + 1)

    def step() -> None:
        with _flash():
            engine.train_step(mb)

    return step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=0, help="override n_layer (0: the preset's)")
    p.add_argument("--compile", action="store_true", help="also time torch.compile")
    p.add_argument("--skip-engine", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("mfu: no GPU present on this machine: nothing to measure")
        return 0
    from trainer.config import GPT_1B
    from trainer.model import count_params, flops_per_token
    from trainer.progress import peak_flops

    cfg = GPT_1B if not args.layers else dataclasses.replace(GPT_1B, n_layer=args.layers)
    name = torch.cuda.get_device_name()
    peak = peak_flops(name, "bf16")
    fpt = flops_per_token(cfg)
    tokens = args.batch * cfg.seq_len
    print(f"device {name}; torch {torch.__version__}; peak bf16 "
          f"{peak / 1e12:.0f} TFLOP/s" if peak else f"device {name}: peak unknown")  # fmt: skip
    print(f"model {count_params(cfg) / 1e9:.3f}B params, {cfg.n_layer} layers, d_model "
          f"{cfg.d_model}, seq {cfg.seq_len}; {fpt / 1e9:.2f} GFLOP/token; batch {args.batch}")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), generator=gen).cuda()
    variants: list[tuple[str, Callable[[], Callable[[], None]]]] = [
        ("plain", lambda: plain_step(cfg, batch, False))
    ]
    if args.compile:
        variants.append(("plain+compile", lambda: plain_step(cfg, batch, True)))
    if not args.skip_engine:
        variants.append(("engine", lambda: engine_step(cfg, batch)))
    rates: dict[str, float] = {}
    print(f"{'variant':<14} {'ms/step':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6}")
    for label, build in variants:
        step = build()
        sec = _time(step, args.warmup, args.steps)
        rates[label] = tokens / sec
        achieved = fpt * rates[label]
        mfu = f"{achieved / peak:.3f}" if peak else "n/a"
        print(f"{label:<14} {sec * 1e3:9.1f} {rates[label]:10.0f} {achieved / 1e12:8.1f} {mfu:>6}")
        del step
        gc.collect()
        torch.cuda.empty_cache()
    if "engine" in rates:
        print(f"engine / plain throughput: {rates['engine'] / rates['plain']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
