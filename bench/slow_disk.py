"""A step's time on the training thread with the run directory behind a writer that stalls
2 s per write, against a normal disk (issue 48).

    .venv/bin/python bench/slow_disk.py                      # 80 steps a mode, 3 rounds
    .venv/bin/python bench/slow_disk.py --steps 40 --rounds 1 --sleep 2

Each mode runs in a process of its own (a gloo group of one on loopback): a small MLP trained
for ``--steps`` steps with ``tracer.attach`` (automatic spans off; a step's forward, backward
and optimizer spans plus ``--spans`` short spans, flushes every 2 steps, ``--max-rows`` rows a
buffer). In ``slow`` mode every Parquet part the tracer writes waits ``--sleep`` seconds first
(the rank's :class:`tracer.writer.PartWriter`, as a hung NFS mount or a saturated disk would
hold it): the flusher thread stalls, its buffers fill, and the training thread is to go on
without waiting, dropping rows with a count. Prints each mode's median and p90 step time (the
first 5 steps left out), their ratio, each mode's dropped rows and what ``close`` took.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
WARMUP = 5


def _one(mode: str, steps: int, spans: int, max_rows: int, sleep: float, port: int) -> None:
    """One mode, in this process: prints a JSON line of step times, drops and close time."""
    import torch
    import torch.distributed as dist

    import tracer
    from tracer.config import TracerConfig

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TracerConfig(hang_timeout_s=0, flush_every_steps=2, flush_every_s=3600,
                           max_rows=max_rows, cpu_budget=0)  # fmt: skip
        tr = tracer.attach(os.path.join(tmp, "run"), auto=False, config=cfg)
        if mode == "slow":
            write = tr.writer.write

            def stalled(table: str, columns: Any) -> Any:
                if len(columns["rank"]):
                    time.sleep(sleep)
                return write(table, columns)

            tr.writer.write = stalled  # type: ignore[method-assign]
        times: list[float] = []
        for step in range(steps):
            t0 = time.perf_counter()
            tracer.step(step)
            with tracer.span("forward"):
                loss = model(x).pow(2).mean()
            with tracer.span("backward"):
                loss.backward()
            with tracer.span("optimizer"):
                opt.step()
                opt.zero_grad()
            for _ in range(spans):
                with tracer.span("data", kind="data"):
                    pass
            times.append(time.perf_counter() - t0)
        dropped = sum(tr.dropped().values())
        t0 = time.perf_counter()
        tracer.close()
        closed = time.perf_counter() - t0
    dist.destroy_process_group()
    print(json.dumps({"times": times, "dropped": dropped, "close_s": closed}))


def _run(mode: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", mode, "--steps", str(args.steps),
           "--spans", str(args.spans), "--max-rows", str(args.max_rows),
           "--sleep", str(args.sleep), "--port", str(port)]  # fmt: skip
    res = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}
    )
    if res.returncode != 0:
        raise SystemExit(f"{mode} run failed: {res.stderr.strip().splitlines()[-1:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    """Both modes, ``--rounds`` times in alternation; the summary."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--spans", type=int, default=200, help="short spans a step, besides the 3")
    p.add_argument("--max-rows", type=int, default=2000, help="rows a buffer holds")
    p.add_argument("--sleep", type=float, default=2.0, help="seconds each write stalls")
    p.add_argument("--one", choices=("normal", "slow"), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=29741, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        _one(args.one, args.steps, args.spans, args.max_rows, args.sleep, args.port)
        return 0
    per: dict[str, list[float]] = {"normal": [], "slow": []}
    dropped: dict[str, list[int]] = {"normal": [], "slow": []}
    close: dict[str, list[float]] = {"normal": [], "slow": []}
    for r in range(args.rounds):
        for i, mode in enumerate(per):
            got = _run(mode, args, 29741 + 2 * r + i)
            per[mode] += got["times"][WARMUP:]
            dropped[mode].append(got["dropped"])
            close[mode].append(got["close_s"])
    med = {m: statistics.median(t) * 1e3 for m, t in per.items()}
    p90 = {m: statistics.quantiles(t, n=10)[-1] * 1e3 for m, t in per.items()}
    for mode in per:
        print(f"{mode:>6}: step median {med[mode]:.2f} ms, p90 {p90[mode]:.2f} ms, "
              f"dropped rows {dropped[mode]}, close {[round(c, 1) for c in close[mode]]} s")  # fmt: skip
    print(f"slow/normal step median: {med['slow'] / med['normal']:.3f} "
          f"(writes stalled {args.sleep:g} s each; {args.rounds} rounds of {args.steps} steps)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
