"""What does tracing cost? The trainer untraced, traced, and under torch.profiler, side by side.

``--runs`` measures whole runs instead, megascope beside TraceML 0.5 (bench/overhead_runs.py:
the same script untraced, traced by megascope and under TraceML, alternated round by round; its
options follow ``--runs``).

    .venv/bin/python bench/tracer_overhead.py                  # 4 CPU ranks, dp=2 pp=2
    .venv/bin/python bench/tracer_overhead.py --mesh dp=4 --rounds 5 --steps 30
    .venv/bin/python bench/tracer_overhead.py --device cuda    # on a GPU machine (NCCL): one
        # rank per GPU present, dp over all of them (dp=1 on one GPU), the 1.2B preset

torchrun starts the ranks once; each rank builds megascope's trainer (``trainer.engine.Engine``
on a ``trainer.parallel.mesh.Mesh``) and then runs blocks of steps in the order untraced,
traced, profiled, repeated ``--rounds`` times, so the three modes share the same processes,
caches and machine load. A block's first ``--warmup`` steps are not timed.

* untraced: the engine with null hooks;
* traced: ``tracer.attach`` (all collectives wrapped), ``tracer.step`` each step, a span around
  data, each microbatch's forward and backward, and the optimizer (as ``trainer.train`` does);
  ``tracer.close`` after the block;
* profiled: the same spans as ``torch.profiler.record_function`` inside
  ``torch.profiler.profile`` (CPU activities, plus CUDA on a GPU), exported as a Chrome trace.

It prints the median step time of each mode on rank 0 (every step ends in DP collectives, so
rank 0's step time is the job's), the ratios traced/untraced and profiled/untraced (over all
steps, and per round: a round's three blocks ran back to back, so a per-round ratio is the
least disturbed by other load on the machine), and the bytes per recorded event: the tracer's
Parquet bytes over its rows (spans, collectives, heartbeats, topology), as written and as
column data only (without each file's footer: what a row costs in a long run, whose parts
are compacted into large files), and the profiler's JSON bytes over its trace events. Targets: traced/
untraced <= 1.03 on CPU with 4 ranks (<= 1.01 on a GPU), <= 16 bytes per event.
"""

from __future__ import annotations

import argparse
import contextlib
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

MODES = ("untraced", "traced", "profiled")


class _ProfilerHooks:
    """The engine's spans as profiler ranges."""

    def span(self, name: str, kind: str = "compute", microbatch: int = -1) -> Any:
        import torch

        return torch.profiler.record_function(f"{name}#{microbatch}")


class _TracerHooks:
    def span(self, name: str, kind: str = "compute", microbatch: int = -1) -> Any:
        import tracer

        return tracer.span(name, kind, microbatch)


def _block(engine: Any, args: argparse.Namespace, mode: str, first: int, hooks: Any) -> list[float]:
    """Run warmup + steps steps; the timed step times in ms."""
    import tracer
    from trainer.data import get_batch

    times = []
    for i in range(args.warmup + args.steps):
        step = first + i
        t0 = time.perf_counter()
        if mode == "traced":
            tracer.step(step)
        with hooks.span("data", "data"):
            batch = get_batch(
                seed=1,
                step=step,
                dp_rank=engine.mesh.coords["dp"],
                microbatches=args.microbatches,
                micro_batch_size=2,
                seq_len=engine.model_cfg.seq_len,
            )
        engine.train_step(batch)
        if i >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def _parquet_stats(run_dir: str, derived: bool = False) -> tuple[int, int, int]:
    """(file bytes, rows, column-data bytes): the last leaves out each file's footer and
    header, i.e. what a row costs once files are large (long runs, compacted parts). The
    recorded tables, or with ``derived`` the digests the tracer writes beside them."""
    import pyarrow.parquet as pq

    from tracer.schema import DERIVED_TABLES

    nbytes = rows = data = 0
    for folder, _, files in os.walk(run_dir):
        table = os.path.relpath(folder, run_dir).split(os.sep)[0]
        if (table in DERIVED_TABLES) != derived:
            continue
        for name in files:
            if name.endswith(".parquet"):
                path = os.path.join(folder, name)
                meta = pq.ParquetFile(path).metadata
                nbytes += os.path.getsize(path)
                rows += meta.num_rows
                for g in range(meta.num_row_groups):
                    group = meta.row_group(g)
                    data += sum(
                        group.column(c).total_compressed_size for c in range(group.num_columns)
                    )
    return nbytes, rows, data


def _merged_bytes(run_dir: str, derived: bool = False) -> int:
    """Bytes of the same rows with each (table, rank) merged into one file, as compaction
    leaves a long run (the bench's short traced blocks each end in a file of their own);
    ``derived`` as in :func:`_parquet_stats`."""
    import glob

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tracer.rundir import write_part
    from tracer.schema import DERIVED_TABLES

    total = 0
    with tempfile.TemporaryDirectory() as tmp:
        for folder in glob.glob(os.path.join(run_dir, "*", "rank=*")):
            table, rank = os.path.basename(os.path.dirname(folder)), int(folder.rsplit("=", 1)[1])
            if (table in DERIVED_TABLES) != derived:
                continue
            paths = sorted(glob.glob(os.path.join(folder, "*.parquet")))
            merged = pa.concat_tables([pq.read_table(p) for p in paths])
            total += os.path.getsize(write_part(tmp, table, rank, merged))
    return total


def hot_path_us(n: int = 20000) -> tuple[float, float, float]:
    """CPU microseconds per call, in this process: a bare call, the same call through the
    tracer's collective wrapper, and an empty ``tracer.span`` (a 1-rank gloo group)."""
    import torch
    import torch.distributed as dist

    import tracer
    from tracer.config import TracerConfig
    from tracer.opspecs import OP_SPECS

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as tmp:
        tr = tracer.attach(tmp, config=TracerConfig(hang_timeout_s=0))

        def bare(*args: Any, **kwargs: Any) -> None:
            return None

        wrapped = tr.recorder.wrapper(OP_SPECS["all_reduce"], bare)
        t = torch.ones(1)
        c0 = time.process_time()
        for _ in range(n):
            bare(t)
        c1 = time.process_time()
        for _ in range(n):
            wrapped(t)
        c2 = time.process_time()
        for _ in range(n):
            with tracer.span("x"):
                pass
        c3 = time.process_time()
        tracer.close()
    dist.destroy_process_group()
    return ((c1 - c0) / n * 1e6, (c2 - c1) / n * 1e6, (c3 - c2) / n * 1e6)


def worker(args: argparse.Namespace) -> None:
    """One rank: build the engine, alternate the modes, rank 0 writes the results."""
    import torch
    import torch.distributed as dist

    import tracer
    from tracer.config import TracerConfig
    from trainer.config import PRESETS, ParallelConfig, TrainConfig
    from trainer.engine import Engine
    from trainer.parallel.mesh import Mesh

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    sizes = dict(kv.split("=") for kv in args.mesh.split(","))
    mesh = Mesh(ParallelConfig(**{k: int(v) for k, v in sizes.items()}))
    engine = Engine(
        PRESETS[args.model],
        TrainConfig(device=args.device, microbatches=args.microbatches),
        mesh,
        _TracerHooks(),
    )
    groups = {a: pg for a, pg in mesh.groups.items() if pg is not None and mesh.sizes[a] > 1}
    results: dict[str, list[list[float]]] = {m: [] for m in MODES}
    prof_bytes = prof_events = 0
    step = 0
    for _ in range(args.rounds):
        for mode in MODES:
            dist.barrier()
            if mode == "untraced":
                results[mode].append(_block(engine, args, mode, step, engine.hooks))
            elif mode == "traced":
                tracer.attach(args.out, mesh=mesh.sizes, groups=groups, config=TracerConfig())
                results[mode].append(_block(engine, args, mode, step, engine.hooks))
                tracer.close()
            else:
                engine.hooks = _ProfilerHooks()
                activities = [torch.profiler.ProfilerActivity.CPU]
                if args.device == "cuda":
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                with torch.profiler.profile(activities=activities) as prof:
                    results[mode].append(_block(engine, args, mode, step, engine.hooks))
                path = os.path.join(args.out, f"profile-{rank}.json")
                prof.export_chrome_trace(path)
                prof_bytes += os.path.getsize(path)
                with open(path) as f:
                    prof_events += len(json.load(f).get("traceEvents", []))
                os.remove(path)
                engine.hooks = _TracerHooks()
            step += args.warmup + args.steps
    if rank == 0:
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump({"times": results, "prof": [prof_bytes, prof_events]}, f)
    dist.barrier()
    del engine
    import gc

    gc.collect()
    dist.destroy_process_group()


def report(args: argparse.Namespace, run: str) -> None:
    """Print medians, per-round ratios (each round's blocks ran back to back) and sizes."""
    with open(os.path.join(run, "bench.json")) as f:
        data = json.load(f)
    blocks = data["times"]
    med = {m: statistics.median(t for b in blocks[m] for t in b) for m in MODES}
    rounds = {
        m: [
            statistics.median(b) / statistics.median(u)
            for b, u in zip(blocks[m], blocks["untraced"], strict=True)
        ]
        for m in ("traced", "profiled")
    }
    pq_bytes, pq_rows, pq_data = _parquet_stats(run)
    merged = _merged_bytes(run)
    dg_bytes, dg_rows, _ = _parquet_stats(run, derived=True)
    dg_merged = _merged_bytes(run, derived=True)
    prof_bytes, prof_events = data["prof"]
    print(f"tracer overhead: {args.nproc} ranks, mesh {args.mesh}, device {args.device}, "
          f"{args.rounds} rounds x {args.steps} steps per mode")  # fmt: skip
    for m in MODES:
        print(f"  {m:<9} median step {med[m]:8.2f} ms")
    for m, target in (("traced", "  (target <= 1.03 CPU, 1.01 GPU)"), ("profiled", "")):
        per_round = " ".join(f"{r:.3f}" for r in rounds[m])
        print(f"  {m}/untraced: median of rounds {statistics.median(rounds[m]):.3f}, "
              f"of all steps {med[m] / med['untraced']:.3f}; rounds: {per_round}{target}")  # fmt: skip
    print(f"  tracer:   {pq_bytes} B Parquet / {pq_rows} rows = "
          f"{pq_bytes / max(pq_rows, 1):.1f} B per event as written, "
          f"{pq_data / max(pq_rows, 1):.1f} B of column data, "
          f"{merged / max(pq_rows, 1):.1f} B merged per rank (target <= 16)")  # fmt: skip
    rank_steps = args.nproc * args.rounds * (args.steps + args.warmup)
    print(f"  digests:  {dg_bytes} B Parquet / {dg_rows} rows as written, {dg_merged} B merged "
          f"per rank: {dg_merged / max(pq_rows, 1):.1f} B more per event, "
          f"{dg_merged / rank_steps:.0f} B per rank-step")  # fmt: skip
    print(f"  profiler: {prof_bytes} B JSON (rank 0) / {prof_events} events = "
          f"{prof_bytes / max(prof_events, 1):.1f} B per event")  # fmt: skip
    bare, wrapped, span = data["hot_path_us"]
    per_step = pq_rows / (args.nproc * args.rounds * (args.steps + args.warmup))
    cost_ms = per_step * max(wrapped - bare, span) / 1e3
    print(f"  hot path (CPU time, one process): a collective {wrapped - bare:.1f} us more "
          f"({bare:.2f} bare), a span {span:.1f} us; ~{per_step:.0f} events per rank-step "
          f"= {cost_ms:.2f} ms per step, {cost_ms / med['untraced'] * 100:.2f}% of it")  # fmt: skip


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _defaults(args: argparse.Namespace) -> None:
    """Size the run to the machine: NCCL refuses two ranks on one GPU, so on cuda one rank per
    GPU present and data parallelism over them; the preset users train on a GPU."""
    if args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if gpus < 1:
            raise SystemExit("tracer_overhead: --device cuda but no GPU is visible")
        args.nproc = args.nproc or gpus
        if args.nproc > gpus:
            raise SystemExit(f"tracer_overhead: {args.nproc} ranks but {gpus} GPU(s)")
        args.mesh = args.mesh or f"dp={args.nproc}"
        args.model = args.model or "gpt-1b"
    else:
        args.nproc = args.nproc or 4
        args.mesh = args.mesh or "dp=2,pp=2"
        args.model = args.model or "tiny"


def main() -> int:
    if "--runs" in sys.argv[1:]:
        from overhead_runs import main as runs  # bench/ is this script's folder

        sys.argv.remove("--runs")
        return runs()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, help="ranks (default: 4 on cpu, one per GPU on cuda)")
    p.add_argument("--mesh", help="default: dp=2,pp=2 on cpu, dp=<GPUs> on cuda")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", choices=("tiny", "gpt-1b"),
                   help="model preset (default: tiny on cpu, gpt-1b on cuda)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--out", default="", help="keep the run directory here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    _defaults(args)
    with contextlib.ExitStack() as stack:
        run = args.out or stack.enter_context(tempfile.TemporaryDirectory(prefix="tracer-bench-"))
        port = _free_port()
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
               f"--master-port={port}", __file__, "--worker", "--out", run, "--mesh", args.mesh, "--device", args.device,
               "--rounds", str(args.rounds), "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--microbatches", str(args.microbatches),
               "--model", args.model]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
        with open(os.path.join(run, "bench.json")) as f:
            data = json.load(f)
        data["hot_path_us"] = hot_path_us()
        with open(os.path.join(run, "bench.json"), "w") as f:
            json.dump(data, f)
        report(args, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
