"""One NCCL rank on one GPU, traced: what tests/test_gpu.py checks (run by torchrun).

Steps of a small matmul model with explicit spans, an all_reduce through the wrappers, and one
through a function captured before the tracer attached (so only Flight Recorder sees it).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def main(run: str) -> None:
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    captured = dist.all_reduce  # bound before attach: the wrappers never see its calls
    import tracer

    tracer.attach(run, mesh={"dp": 1, "pp": 1, "tp": 1, "cp": 1})
    w = torch.randn(2048, 2048, device="cuda")
    x = torch.randn(64, 2048, device="cuda")
    for step in range(6):
        tracer.step(step)
        with tracer.span("forward", microbatch=0):
            for _ in range(20):
                x = torch.tanh(x @ w)
        grad = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(grad)  # wrapped: CUDA-event timed
        captured(torch.ones(1 << 18, device="cuda"))  # only Flight Recorder records it
    torch.cuda.synchronize()
    tracer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
