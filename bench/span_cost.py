"""What one span costs the thread that draws it, with and without reading its wait for a core.

    .venv/bin/python bench/span_cost.py                 # 200,000 spans, 5 rounds
    .venv/bin/python bench/span_cost.py --spans 50000 --rounds 3

One process, a gloo group of one on loopback, ``tracer.attach`` with automatic spans off, then
``--rounds`` rounds of ``--spans`` empty host spans (``with tracer.span("forward")``, a step
every 1,000), each round twice: with the tracer reading each span's run-queue delay
(``runq_ns``, Linux's ``/proc/thread-self/schedstat``) and with that read turned off, in
alternation. Prints the median ns per span of each and their difference: what ``runq_ns`` adds
per span, to set beside a step's span count (the trainer draws 10-30 host spans a step on a CPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

STEP = 1000  # spans a step
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spans", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()

    import torch.distributed as dist

    import tracer
    from tracer import clock
    from tracer.config import TracerConfig

    if not clock.read_runq(True):
        print("this system gives no per-thread run-queue delay: nothing to compare")
        return 0
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29731")
    dist.init_process_group("gloo", rank=0, world_size=1)
    per: dict[str, list[float]] = {"with runq_ns": [], "without": []}
    with tempfile.TemporaryDirectory() as tmp:
        tracer.attach(os.path.join(tmp, "run"), auto=False,
                      config=TracerConfig(hang_timeout_s=0, flush_every_s=3600))  # fmt: skip
        tracer.step(0)
        for _ in range(args.rounds):
            for mode in per:
                clock.read_runq(mode == "with runq_ns")
                t0 = time.perf_counter_ns()
                for i in range(args.spans):
                    with tracer.span("forward"):
                        pass
                    if i % STEP == STEP - 1:  # a step's rows are flushed in the background
                        tracer.step(i // STEP + 1)
                per[mode].append((time.perf_counter_ns() - t0) / args.spans)
        clock.read_runq(True)
        tracer.close()
    dist.destroy_process_group()
    med = {m: statistics.median(v) for m, v in per.items()}
    print(f"{args.spans} spans x {args.rounds} rounds, median ns per span:")
    for m, v in med.items():
        print(f"  {m:13s} {v:8.0f}   rounds: {', '.join(f'{x:.0f}' for x in per[m])}")
    print(f"  runq_ns adds {med['with runq_ns'] - med['without']:.0f} ns per span")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
