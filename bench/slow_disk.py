"""A step's time on the training thread with the run directory behind a writer that stalls
2 s per write, against a normal disk (issue 48).

    .venv/bin/python bench/slow_disk.py                      # 80 steps a mode, 3 rounds
    .venv/bin/python bench/slow_disk.py --steps 40 --rounds 1 --sleep 2
    .venv/bin/python bench/slow_disk.py --steps 40 --rounds 1 --trainer   # the trainer's too

Each mode runs in a process of its own (a gloo group of one on loopback): a small MLP trained
for ``--steps`` steps with ``tracer.attach`` (automatic spans off; a step's forward, backward
and optimizer spans plus ``--spans`` short spans, flushes every 2 steps, ``--max-rows`` rows a
buffer). In ``slow`` mode every Parquet part the tracer writes waits ``--sleep`` seconds first
(the rank's :class:`tracer.writer.PartWriter`, as a hung NFS mount or a saturated disk would
hold it): the flusher thread stalls, its buffers fill, and the training thread is to go on
without waiting, dropping rows with a count. Prints each mode's median and p90 step time (the
first 5 steps left out), their ratio, each mode's dropped rows and what ``close`` took.

With ``--trainer``, also the trainer's own loop (``trainer.train.train``, a gloo group of one,
a GPT of one layer, d_model 32, on the CPU, traced): in ``trainer-slow`` every file write of the rank (the
tracer's parts and the progress writer's files) stalls ``--sleep`` s first. A step's time is
the time between two of its progress lines; its dropped count is the progress writer's step
records (a queue of 16 here).
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
MODES = ("normal", "slow", "trainer-normal", "trainer-slow")


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


def _trainer(mode: str, steps: int, sleep: float, port: int) -> None:
    """The trainer's own loop (trainer/train.py ``train``, a gloo group of one, traced) in this
    process: in ``trainer-slow`` every file write of the rank stalls ``sleep`` seconds first,
    the tracer's parts and the progress writer's files alike. A step's time is the time between
    two of its progress lines, on the training thread. Prints a JSON line."""
    import torch.distributed as dist

    from tracer.writer import PartWriter
    from trainer import progress
    from trainer.cliconfig import from_mapping
    from trainer.train import train

    slow = mode == "trainer-slow"

    class Timed(progress.ProgressWriter):
        """The rank's progress writer, its writes stalled in slow mode; step lines timed."""

        stamps: list[float] = []

        def perform(self, job: progress.Pending) -> None:
            if slow:
                time.sleep(sleep)
            super().perform(job)

        def rank_line(self, step: int, state: str) -> None:
            super().rank_line(step, state)
            if state == "step":
                self.stamps.append(time.perf_counter())

    if slow:
        write = PartWriter.write

        def stalled(self: PartWriter, table: str, columns: Any) -> Any:
            if len(columns["rank"]):
                time.sleep(sleep)
            return write(self, table, columns)

        PartWriter.write = stalled  # type: ignore[method-assign]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", MEGASCOPE_FLUSH_STEPS="2")  # fmt: skip
    dist.init_process_group("gloo", rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as tmp:
        run = os.path.join(tmp, "run")
        os.makedirs(progress.progress_dir(run))
        cfg = from_mapping({"model": {"n_layer": 1, "d_model": 32, "seq_len": 16},
                            "parallel": {}, "train": {"steps": steps, "microbatches": 1},
                            "run": {"out": run}})  # fmt: skip
        writer = Timed(run, 0, queue=16)
        train(cfg, 0, writer)
        t0 = time.perf_counter()
        writer.close()
        closed = time.perf_counter() - t0
        times = [b - a for a, b in zip(Timed.stamps, Timed.stamps[1:], strict=False)]
    dist.destroy_process_group()
    print(json.dumps({"times": times, "dropped": writer.dropped, "close_s": closed}))


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
    p.add_argument(
        "--trainer",
        action="store_true",
        help="also the trainer's own step (trainer-normal, trainer-slow)",
    )
    p.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=29741, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one in ("normal", "slow"):
        _one(args.one, args.steps, args.spans, args.max_rows, args.sleep, args.port)
        return 0
    if args.one:
        _trainer(args.one, args.steps, args.sleep, args.port)
        return 0
    modes = MODES if args.trainer else MODES[:2]
    per: dict[str, list[float]] = {m: [] for m in modes}
    dropped: dict[str, list[int]] = {m: [] for m in modes}
    close: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for i, mode in enumerate(per):
            got = _run(mode, args, 29741 + len(modes) * r + i)
            per[mode] += got["times"][WARMUP:]
            dropped[mode].append(got["dropped"])
            close[mode].append(got["close_s"])
    med = {m: statistics.median(t) * 1e3 for m, t in per.items()}
    p90 = {m: statistics.quantiles(t, n=10)[-1] * 1e3 for m, t in per.items()}
    for mode in per:
        print(f"{mode:>14}: step median {med[mode]:.2f} ms, p90 {p90[mode]:.2f} ms, "
              f"dropped rows {dropped[mode]}, close {[round(c, 1) for c in close[mode]]} s")  # fmt: skip
    print(f"slow/normal step median: {med['slow'] / med['normal']:.3f} "
          f"(writes stalled {args.sleep:g} s each; {args.rounds} rounds of {args.steps} steps)")  # fmt: skip
    if args.trainer:
        print(f"trainer slow/normal step median: "
              f"{med['trainer-slow'] / med['trainer-normal']:.3f}, dropped step records "
              f"{dropped['trainer-slow']} (normal {dropped['trainer-normal']})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
