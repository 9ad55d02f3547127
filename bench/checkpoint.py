"""What do checkpoints cost the training step? Side by side, the same CPU run without
checkpoints, with synchronous ones and with asynchronous ones (``--checkpoint-async``):

    .venv/bin/python bench/checkpoint.py                        # 3 rounds, dp2, 30 steps, every 5
    .venv/bin/python bench/checkpoint.py --slow-disk 150         # the disk 150 ms slower per write

Each round runs the three modes back to back (``megascope train``, traced), so that they see
the same machine load, and the run without checkpoints twice: how far two equal runs differ is
the noise the other ratios are read against. From each run's spans: the median step time over
the steps past the warm-up that save no checkpoint, and the median time of the checkpoint steps
(the final one, at the end of the run, left out; in the runs without checkpoints, the same step
numbers). Printed per mode: the median step, its ratio to the same round's run without
checkpoints (median and range over the rounds), the checkpoint steps' time and that of the
steps after them (where a background write competes for the cores), the share of the run's
time the two add (within each run, so the machine's drift between runs cancels), and the
checkpoint's snapshot, write and wait as the spans measure them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("none", "none again", "sync", "async")  # "none again": how far two equal runs differ


def train(out: str, mode: str, args: argparse.Namespace) -> None:
    cmd = [sys.executable, "-m", "analyzer", "train", "--dp", str(args.dp), "--steps",
           str(args.steps), "--out", out]  # fmt: skip
    saves = mode in ("sync", "async")
    if saves:
        cmd += ["--checkpoint-every", str(args.every)]
    if mode == "async":
        cmd += ["--checkpoint-async"]
    if saves and args.slow_disk:
        cmd += ["--inject", f"slow_ckpt:ms={args.slow_disk}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")


def measure(run_dir: str, saving: list[int], last: int) -> dict[str, float]:
    """Median step time of the plain steps (past the warm-up, before the ``last`` one, which
    saves the final checkpoint) and of the ``saving`` steps, and the checkpoint's spans per
    saving step (medians over ranks, then over steps), in ms."""
    from analyzer.db import open_run

    run = open_run(run_dir)
    try:
        steps = run.sql("select step, median(step_ns) / 1e6 as ms from steps group by step")
        spans = run.sql(
            "select step, name, kind, median(end_ns - start_ns) / 1e6 as ms from spans "
            "where name like 'checkpoint_%' group by step, name, kind"
        )
    finally:
        run.close()
    per_step = dict(zip(steps["step"].astype(int), steps["ms"], strict=True))
    plain = [ms for s, ms in per_step.items() if 2 <= s < last and s not in saving]
    ckpt = [per_step[s] for s in saving if s in per_step]
    after = [per_step[s + 1] for s in saving if s + 1 in per_step]
    spans = spans[spans["step"].isin(saving)]

    def part(name: str, background: bool = False) -> float:
        rows = spans[(spans["name"] == name) & ((spans["kind"] == "background") == background)]
        return float(rows.groupby("step")["ms"].sum().median()) if len(rows) else 0.0

    return {
        "step": statistics.median(plain),
        "ckpt": statistics.median(ckpt),
        "after": statistics.median(after),
        "snapshot": part("checkpoint_snapshot"),
        "persist": part("checkpoint_persist"),
        "background": part("checkpoint_persist", background=True),
        "wait": part("checkpoint_wait"),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--slow-disk", type=int, default=0, metavar="MS", help="slow_ckpt:ms=MS")
    args = p.parse_args()
    saving = [s - 1 for s in range(args.every, args.steps, args.every)]  # steps that save
    got: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="megascope-bench-") as tmp:
        for r in range(args.rounds):
            for mode in MODES:
                out = os.path.join(tmp, f"{mode.replace(' ', '-')}-{r}")
                train(out, mode, args)
                got[mode].append(measure(out, saving, args.steps - 1))
                print(f"round {r + 1} {mode}: {got[mode][-1]}", file=sys.stderr, flush=True)
    _print(got, args, saving)
    return 0


def _print(got: dict[str, list[dict[str, float]]], args: argparse.Namespace, saving: list[int]):
    def med(mode: str, key: str) -> float:
        return statistics.median(x[key] for x in got[mode])

    print(f"dp{args.dp}, {args.steps} steps, a checkpoint every {args.every} (steps {saving}), "
          f"{args.rounds} rounds" + (f", slow_ckpt:ms={args.slow_disk}" if args.slow_disk
                                     else ""))  # fmt: skip
    print(
        "| mode | median step ms | step / none (rounds) | checkpoint step ms | step after ms "
        "| time added | snapshot ms | write in step ms | background write ms | wait ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode in MODES:
        ratios = [x["step"] / y["step"] for x, y in zip(got[mode], got["none"], strict=True)]
        added = [(x["ckpt"] + x["after"] - 2 * x["step"]) / (args.every * x["step"])
                 for x in got[mode]]  # fmt: skip
        print(f"| {mode} | {med(mode, 'step'):.1f} | {statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}) | {med(mode, 'ckpt'):.1f} | "
              f"{med(mode, 'after'):.1f} | {statistics.median(added):+.1%} | "
              f"{med(mode, 'snapshot'):.1f} | {med(mode, 'persist'):.1f} | "
              f"{med(mode, 'background'):.1f} | {med(mode, 'wait'):.1f} |")  # fmt: skip
    print(
        "step / none: each round's median step over the same round's run without checkpoints "
        "(median, range); time added: what the checkpoint step and the one after it take "
        "beyond two median steps, over the steps between checkpoints, within each run "
        "(median over the rounds)"
    )


if __name__ == "__main__":
    sys.exit(main())
