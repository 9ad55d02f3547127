"""``megascope plan`` against measured runs: four layouts of 4 CPU ranks, each predicted from
each other.

    .venv/bin/python bench/plan_accuracy.py                 # 4 trainings (~20 s each), then plans
    .venv/bin/python bench/plan_accuracy.py --steps 30 --reuse

The trainer runs the same model and global batch (16 microbatches of 2 sequences) as dp4,
dp2 x tp2, dp2 x pp2 and tp2 x pp2, traced, each launch held under the machine's CPU lock
(``flock /tmp/megascope-cpu.lock``). Each run is then planned (``analyzer.plan.plan_run``,
without recompute, sharded optimizer: the trainer's own settings) and its predictions of the
other three layouts are printed against their measured median step time, with the error;
the diagonal is each run's self-check. The ranking check compares, for each run's plan, the
order of every pair of layouts whose measured medians differ by more than their noise (the
sum of the two runs' step-time MADs x 1.4826, twice) with the measured order.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DATA = os.path.join(ROOT, "bench", ".data", "plan_accuracy")
LOCK = "/tmp/megascope-cpu.lock"
LAYOUTS = {"dp4": (4, 1, 1), "dp2xtp2": (2, 2, 1), "dp2xpp2": (2, 1, 2), "tp2xpp2": (1, 2, 2)}
MODEL = """[model]
preset = "tiny"
d_model = 128
seq_len = 128
[train]
micro_batch_size = 2
device = "cpu"
"""


def train(name: str, dp: int, tp: int, pp: int, steps: int, global_mb: int) -> str:
    out = os.path.join(DATA, name)
    if os.path.exists(os.path.join(out, "run.json")):
        return out
    cfg = os.path.join(DATA, "model.toml")
    with open(cfg, "w", encoding="utf-8") as f:
        f.write(MODEL)
    cmd = ["flock", LOCK, sys.executable, "-m", "analyzer", "train", "--config", cfg,
           "--dp", str(dp), "--tp", str(tp), "--pp", str(pp), "--microbatches",
           str(global_mb // dp), "--steps", str(steps), "--out", out]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{name}: megascope train exited {done.returncode}: {done.stderr[-400:]}")
    return out


def step_noise(run_dir: str) -> tuple[float, float]:
    """The run's median step time and its MAD x 1.4826, in ms (rank 0's step spans, after
    the first step)."""
    import numpy as np

    from analyzer.db import open_run

    run = open_run(run_dir)
    df = run.sql("select step, (end_ns - start_ns) / 1e6 as ms from spans "
                 "where name = 'step' and rank = 0 and end_ns is not null order by step")  # fmt: skip
    ms = df.ms.to_numpy()[1:]
    med = float(np.median(ms))
    return med, float(1.4826 * np.median(np.abs(ms - med)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--global-microbatches", type=int, default=16)
    ap.add_argument("--reuse", action="store_true", help="keep the runs already under bench/.data")
    args = ap.parse_args()
    from analyzer.plan import plan_run

    if not args.reuse and os.path.isdir(DATA):
        import shutil

        shutil.rmtree(DATA)
    os.makedirs(DATA, exist_ok=True)
    runs = {n: train(n, *lay, args.steps, args.global_microbatches) for n, lay in LAYOUTS.items()}
    measured = {n: step_noise(r) for n, r in runs.items()}
    pred: dict[str, dict[str, float]] = {}
    for src, run_dir in runs.items():
        plan = plan_run(run_dir, recompute=False, sharding=False)
        by = {(x["dp"], x["tp"], x["pp"]): x["predicted_step_ms"] for x in plan["layouts"]
              if x["cp"] == 1}  # fmt: skip
        pred[src] = {dst: by[lay] for dst, lay in LAYOUTS.items()}
    names = list(LAYOUTS)
    print("measured median step (ms, +- MAD): "
          + ", ".join(f"{n} {m:.1f} +- {s:.1f}" for n, (m, s) in measured.items()))  # fmt: skip
    print(f"\n{'planned from':<14}" + "".join(f"{n:>22}" for n in names))
    worst, ranking = 0.0, []
    for src in names:
        cells = []
        for dst in names:
            p, m = pred[src][dst], measured[dst][0]
            err = p / m - 1.0
            if src != dst:
                worst = max(worst, abs(err))
            cells.append(f"{p:7.1f} vs {m:6.1f} {100 * err:+5.1f}%")
        print(f"{src:<14}" + "".join(f"{c:>22}" for c in cells))
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                (ma, sa), (mb, sb) = measured[a], measured[b]
                if abs(ma - mb) > 2 * (sa + sb):
                    ranking.append((ma < mb) == (pred[src][a] < pred[src][b]))
    print(f"\nworst error off the diagonal: {100 * worst:.1f}% (target: within 20%)")
    print(f"ranking: {sum(ranking)} of {len(ranking)} pairs beyond the noise in the measured order")
    print(json.dumps({"measured": measured, "predicted": pred}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
