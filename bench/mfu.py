"""MFU of the ~1B GPT preset on one GPU: tokens/s, achieved TFLOP/s, peak and MFU.

    python bench/mfu.py [--batch 4] [--microbatches 4] [--steps 10] [--warmup 3] [--layers N]

Measures, side by side in one process and on the same data (``--microbatches`` microbatches of
``--batch`` sequences per step, as ``megascope train --micro-batch-size B --microbatches M``):

* ``plain`` and ``plain+compile`` — ``trainer.model.GPT`` with bf16 autocast, flash attention
  forced through ``sdpa_kernel(FLASH_ATTENTION)``, gradients accumulated over the
  microbatches and a fused AdamW (``torch.compile`` of the model in the second): the ceiling
  of this model on this GPU;
* ``engine``, ``engine+trace``, ``engine+compile``, ``engine+compile+trace`` — the trainer's own
  :class:`trainer.engine.Engine` on a world of one rank (what ``megascope train --device cuda
  --dtype bf16`` runs: compiled blocks by default on CUDA), untraced and with the tracer
  attached as ``megascope train`` attaches it (spans around data, each microbatch's forward
  and backward and the optimizer; CUDA events), the loss read once per step.

Each variant runs ``--warmup`` untimed steps, then ``--steps`` steps between two
``torch.cuda.synchronize()`` calls. Achieved FLOP/s = ``flops_per_token`` (PaLM's 6N + 12LCT
count, :func:`trainer.model.flops_per_token`) x tokens/s; MFU = achieved / the device's dense
bf16 peak (:data:`trainer.progress.PEAK_TFLOPS`, by device name; unknown devices print
``n/a``). The last column is each variant's throughput over the plain model's, and the
traced/untraced ratio of each engine is printed after the table.

On a machine without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
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
    """One optimizer step of the bare model over the microbatches of ``batch`` (M, B, T + 1):
    bf16 autocast, flash SDPA, gradients accumulated, fused AdamW."""
    from trainer.model import GPT

    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), fused=True)
    fwd = torch.compile(model) if compile_ else model
    x, y = batch[..., :-1], batch[..., 1:]

    def step() -> None:
        for mb in range(batch.size(0)):
            with _flash(), torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fwd(x[mb], y[mb]) / batch.size(0)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


class _TracerHooks:
    def span(self, name: str, kind: str = "compute", microbatch: int = -1):
        import tracer

        return tracer.span(name, kind, microbatch)


def engine_steps(cfg, batch: torch.Tensor, compile_: bool, out: str):
    """The engine on a world of one rank: (untraced step, traced step, close), the traced one
    recording into ``out`` as ``megascope train`` does."""
    import tracer
    from tracer.config import TracerConfig
    from trainer.config import ParallelConfig, TrainConfig
    from trainer.engine import Engine
    from trainer.hooks import NullHooks
    from trainer.parallel.mesh import Mesh

    train = TrainConfig(steps=1000, microbatches=batch.size(0), micro_batch_size=batch.size(1),
                        device="cuda", dtype="bf16", compile=compile_)  # fmt: skip
    engine = Engine(cfg, train, Mesh(ParallelConfig()))
    count = [0]

    def untraced() -> None:
        engine.hooks = NullHooks()
        with _flash():
            float(engine.train_step_async(batch))

    def traced() -> None:
        if tracer.current() is None or tracer.current().closed:
            tracer.attach(out, mesh={"dp": 1, "pp": 1, "tp": 1}, config=TracerConfig())
        engine.hooks = _TracerHooks()
        tracer.step(count[0])
        count[0] += 1
        with tracer.span("data", "data"):
            mb = batch.clone()
        with _flash():
            float(engine.train_step_async(mb))

    def close() -> None:
        tracer.close()

    return untraced, traced, close


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4, help="sequences per microbatch")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=0, help="override n_layer (0: the preset's)")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled variants")
    p.add_argument("--skip-engine", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("mfu: no GPU present on this machine: nothing to measure")
        return 0
    import tempfile

    import torch.distributed as dist

    from trainer.config import GPT_1B
    from trainer.model import count_params, flops_per_token
    from trainer.progress import peak_flops

    cfg = GPT_1B if not args.layers else dataclasses.replace(GPT_1B, n_layer=args.layers)
    name = torch.cuda.get_device_name()
    peak = peak_flops(name, "bf16")
    fpt = flops_per_token(cfg)
    tokens = args.microbatches * args.batch * cfg.seq_len
    print(f"device {name}; torch {torch.__version__}; peak bf16 "
          f"{peak / 1e12:.0f} TFLOP/s" if peak else f"device {name}: peak unknown")  # fmt: skip
    print(f"model {count_params(cfg) / 1e9:.3f}B params, {cfg.n_layer} layers, d_model "
          f"{cfg.d_model}, seq {cfg.seq_len}; {fpt / 1e9:.2f} GFLOP/token; "
          f"{args.microbatches} x {args.batch} sequences per step")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    shape = (args.microbatches, args.batch, cfg.seq_len + 1)
    batch = torch.randint(0, cfg.vocab_size, shape, generator=gen).cuda()
    compiles = (False,) if args.no_compile else (False, True)
    rates: dict[str, float] = {}

    def measure(label: str, step: Callable[[], None]) -> None:
        sec = _time(step, args.warmup, args.steps)
        rates[label] = tokens / sec
        achieved = fpt * rates[label]
        mfu = f"{achieved / peak:.3f}" if peak else "n/a"
        ratio = rates[label] / rates["plain"] if "plain" in rates else 1.0
        print(f"{label:<22} {sec * 1e3:9.1f} {rates[label]:10.0f} {achieved / 1e12:8.1f} "
              f"{mfu:>6} {ratio:9.3f}", flush=True)  # fmt: skip

    print(
        f"{'variant':<22} {'ms/step':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'vs plain':>9}"
    )
    for c in compiles:
        step = plain_step(cfg, batch, c)
        measure("plain+compile" if c else "plain", step)
        del step
        _free()
    if not args.skip_engine:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1)
        with tempfile.TemporaryDirectory() as out:
            for c in compiles:
                label = "engine+compile" if c else "engine"
                untraced, traced, close = engine_steps(cfg, batch, c, os.path.join(out, label))
                measure(label, untraced)
                measure(label + "+trace", traced)
                close()
                del untraced, traced, close
                _free()
        dist.destroy_process_group()
        for c in compiles:
            label = "engine+compile" if c else "engine"
            print(f"{label}: traced / untraced step time "
                  f"{rates[label] / rates[label + '+trace']:.4f}")  # fmt: skip
    return 0


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
