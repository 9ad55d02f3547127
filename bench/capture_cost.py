"""What the collective wrapper's bookkeeping costs per call, as the tracer counts it.

    .venv/bin/python bench/capture_cost.py                  # 20,000 all_reduces, 5 rounds
    .venv/bin/python bench/capture_cost.py --calls 5000 --rounds 3

One process, a gloo group of one on loopback, ``tracer.attach`` with automatic spans off, then
``--rounds`` rounds of ``--calls`` ``dist.all_reduce`` of a one-element tensor (a step every
100): the one-tensor wrapper, the hot path of nearly every collective of a training step. The
tracer counts the time of its own bookkeeping around each call (``Budget.capture_ns``, the
wrapper's time outside the real call); this prints its median over the rounds, in ns per call,
and the median wall time per call with the real call inside.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

STEP = 100  # calls a step
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    import tracer
    from tracer.config import TracerConfig

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29581")
    dist.init_process_group("gloo", rank=0, world_size=1)
    t = torch.ones(1)
    own, wall = [], []
    with tempfile.TemporaryDirectory(prefix="megascope-capture-") as tmp:
        tr = tracer.attach(os.path.join(tmp, "run"), auto=False, config=TracerConfig(nvml_hz=0))
        step = 0
        for _ in range(args.rounds):
            before = tr.budget.capture_ns
            t0 = time.perf_counter_ns()
            for i in range(args.calls):
                if i % STEP == 0:
                    tracer.step(step)
                    step += 1
                dist.all_reduce(t)
            wall.append((time.perf_counter_ns() - t0) / args.calls)
            own.append((tr.budget.capture_ns - before) / args.calls)
        tracer.close()
    dist.destroy_process_group()
    print(f"{args.rounds} rounds of {args.calls} all_reduce: the tracer's own "
          f"{statistics.median(own):.0f} ns a call (rounds: {', '.join(f'{x:.0f}' for x in own)}); "
          f"wall {statistics.median(wall):.0f} ns a call")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
