"""What does tracing cost a script that knows nothing of megascope? Side by side, untraced and
traced by ``tracer.run``, the example scripts (plain DDP; FSDP2, alone and with tensor
parallelism) on 4 CPU ranks:

    .venv/bin/python bench/script_overhead.py                    # 3 rounds of 30 steps
    .venv/bin/python bench/script_overhead.py --rounds 5 --steps 60 --scripts ddp

Each round runs every script untraced, then traced (``MEGASCOPE_TRACE=... torchrun -m
tracer.run``), back to back, so that both see the same machine load; a script prints its own
median step time (its first two steps left out). Printed per script: the median step of each
mode over the rounds, the traced/untraced ratio of each round and their median, and what
reading Flight Recorder cost rank 0 (reads, seconds, share of the traced run's step time). The
target is the tracer's budget, traced/untraced <= 1.01 (1% on CPU); on a shared 2-core machine
a single round varies by more than that, so read the median of the rounds and the reader's own
share, which is measured directly.

On a GPU (``--nproc 1`` on one device: NCCL refuses two ranks on one GPU), ``--nccl-timing``
adds a third run per round, traced with NCCL's device timing off (``TORCH_NCCL_ENABLE_TIMING=0``,
``MEGASCOPE_NCCL_TIMING=0``), and prints what turning it on costs; ``--args`` passes the
scripts a bigger model:

    python bench/script_overhead.py --nproc 1 --scripts ddp --nccl-timing \
        --args "--dim 1024 --layers 8 --seq 512"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {
    "ddp": ["ddp.py"],
    "fsdp2": ["fsdp2_tp.py", "--tp", "1"],
    "fsdp2_tp": ["fsdp2_tp.py", "--tp", "2"],
}
STEP = re.compile(r"median step ([0-9.]+) ms")
sys.path.insert(0, ROOT)

from tracer.loopback import free_port  # noqa: E402


def run(
    script: list[str], steps: int, trace_dir: str | None, nproc: int = 4, timing: bool = True
) -> float:
    """One torchrun of a script; its median step in ms."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": ROOT}
    if trace_dir:
        cmd += ["-m", "tracer.run"]
        env["MEGASCOPE_TRACE"] = trace_dir
    if not timing:
        env.update(TORCH_NCCL_ENABLE_TIMING="0", MEGASCOPE_NCCL_TIMING="0")
    cmd += [os.path.join(ROOT, "examples", script[0]), *script[1:], "--steps", str(steps)]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    m = STEP.search(out.stdout)
    if out.returncode != 0 or m is None:
        raise SystemExit(f"{' '.join(script)} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return float(m.group(1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--scripts", default=",".join(SCRIPTS), help="of: " + ", ".join(SCRIPTS))
    p.add_argument("--nproc", type=int, default=4, help="ranks (1 on one GPU)")
    p.add_argument("--nccl-timing", action="store_true", help="also traced without NCCL timing")
    p.add_argument("--args", default="", help="more arguments for every script")
    args = p.parse_args()
    names = [n for n in args.scripts.split(",") if n]
    extra = args.args.split()
    untimed: dict[str, list[float]] = {n: [] for n in names}
    results: dict[str, dict[str, list[float]]] = {n: {"untraced": [], "traced": []} for n in names}
    reader: dict[str, list[float]] = {n: [0.0, 0.0] for n in names}  # reads, seconds
    with tempfile.TemporaryDirectory(prefix="megascope-bench-") as tmp:
        for r in range(args.rounds):
            for name in names:
                script, n = SCRIPTS[name] + extra, args.nproc
                results[name]["untraced"].append(run(script, args.steps, None, n))
                trace_dir = os.path.join(tmp, f"{name}-{r}")
                results[name]["traced"].append(run(script, args.steps, trace_dir, n))
                if args.nccl_timing:
                    off = os.path.join(tmp, f"{name}-{r}-untimed")
                    untimed[name].append(run(script, args.steps, off, n, timing=False))
                with open(os.path.join(trace_dir, "run.json")) as f:
                    fr = json.load(f).get("summary", {}).get("flight_recorder", {})
                reader[name][0] += fr.get("reads", 0)
                reader[name][1] += fr.get("read_s", 0.0)
                print(f"  round {r + 1} {name}: untraced {results[name]['untraced'][-1]:.1f} ms, "
                      f"traced {results[name]['traced'][-1]:.1f} ms", flush=True)  # fmt: skip
    print(f"\n{args.rounds} rounds x {args.steps} steps, {args.nproc} ranks")
    print(f"{'script':10} {'untraced':>10} {'traced':>10} {'ratio':>7}  per round    reader")
    for name in names:
        un, tr = results[name]["untraced"], results[name]["traced"]
        ratios = [t / u for t, u in zip(tr, un, strict=True)]
        reads, secs = reader[name]
        share = secs / (args.rounds * args.steps * statistics.median(tr) / 1e3)
        print(f"{name:10} {statistics.median(un):8.1f}ms {statistics.median(tr):8.1f}ms "
              f"{statistics.median(ratios):7.3f}  {' '.join(f'{x:.2f}' for x in ratios)}  "
              f"{int(reads)} reads, {secs * 1e3:.0f} ms = {share:.2%} of the steps")  # fmt: skip
        if untimed[name]:
            on = [t / u for t, u in zip(tr, untimed[name], strict=True)]
            print(f"{'':10} traced without NCCL timing {statistics.median(untimed[name]):.1f} ms: "
                  f"timing on/off {statistics.median(on):.4f} ({' '.join(f'{x:.3f}' for x in on)})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
