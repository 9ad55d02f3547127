"""One run analyzed by two versions of megascope: the same report, and the time of each.

    .venv/bin/python bench/same_report.py --before f5d45b2                 # the 12,288-rank run
    .venv/bin/python bench/same_report.py --before f5d45b2 --run RUN --rounds 5
    .venv/bin/python bench/same_report.py --before 4f7a29d --samples [--keep DIR]

A change that should not change behaviour (a module moved, a reader shared) is checked here: the
run (by default the 12,288-rank benchmark run of bench/analyzer_scale.py, synthesized once under
bench/.data/) is analyzed by ``megascope analyze --json`` from this checkout and from a
checkout of ``--before`` (a git worktree made for the purpose), alternated round by round, each
in a cold process. Prints whether the findings are the same (kind, ranks, severity, steps) and
each version's median wall time and their ratio.

With ``--samples``, the reports' bytes: every run under samples/ and tests/data/cpu_runs/ is
analyzed by both versions (the JSON report, the text, Markdown and HTML reports, and for the
samples the report per window), the samples are compared and gathered in a fleet (JSON and
text), and each output is compared byte for byte; prints each that differs and exits 1 if any
does. ``--keep DIR`` writes both versions' outputs under DIR/before and DIR/now.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from analyzer_scale import DATA, ensure_run  # noqa: E402

# the id plotly gives each figure of an HTML report (a random UUID, new on every call)
PLOTLY_ID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def analyze(checkout: str, run: str) -> tuple[dict, float]:
    """The report of ``run`` by the code at ``checkout``, and the wall time it took."""
    env = {**os.environ, "PYTHONPATH": checkout}
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "analyzer", "analyze", run, "--json"],
                          cwd=checkout, env=env, capture_output=True, text=True)  # fmt: skip
    took = time.monotonic() - t0
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: analyze failed: {done.stderr.strip()[-400:]}")
    return json.loads(done.stdout), took


def essence(report: dict) -> list[tuple]:
    """What must not change: each finding's kind, ranks, severity and steps."""
    return [(f["kind"], tuple(f["ranks"]), f["severity"], tuple(f.get("steps") or ()))
            for f in report["findings"]]  # fmt: skip


def sample_commands() -> list[tuple[str, list[str]]]:
    """(name, megascope arguments) of every output ``--samples`` compares."""
    samples = sorted(d for d in glob.glob(os.path.join(ROOT, "samples", "*"))
                     if os.path.isfile(os.path.join(d, "run.json")))  # fmt: skip
    cpu_runs = sorted(d for d in glob.glob(os.path.join(ROOT, "tests", "data", "cpu_runs", "*"))
                      if os.path.isfile(os.path.join(d, "run.json")))  # fmt: skip
    out: list[tuple[str, list[str]]] = []
    for run in samples + cpu_runs:
        name = os.path.relpath(run, ROOT).replace(os.sep, "_")
        out += [
            (f"{name}.json", ["analyze", run, "--json"]),
            (f"{name}.txt", ["analyze", run]),
            (f"{name}.md", ["analyze", run, "--format", "markdown"]),
            (f"{name}.html", ["analyze", run, "--format", "html"]),
        ]
        if run in samples:
            out.append((f"{name}.windows.json", ["analyze", run, "--windows", "4", "--json"]))
    by_name = {os.path.basename(r): r for r in samples}
    if "healthy" in by_name and "slow_rank" in by_name:
        pair = [by_name["healthy"], by_name["slow_rank"]]
        out += [("compare_healthy_slow_rank.json", ["compare", *pair, "--json"]),
                ("compare_healthy_slow_rank.txt", ["compare", *pair])]  # fmt: skip
    if samples:
        out += [("fleet_samples.json", ["fleet", *samples, "--json"]),
                ("fleet_samples.txt", ["fleet", *samples])]  # fmt: skip
    return out


def output_of(checkout: str, argv: list[str]) -> bytes:
    """What ``megascope ARGV`` prints from the code at ``checkout`` (stdout, then the exit
    status, so that a changed status is a difference too). The ids plotly draws at random for
    each figure of an HTML report are made one placeholder; nothing else is touched."""
    env = {**os.environ, "PYTHONPATH": checkout}
    done = subprocess.run([sys.executable, "-m", "analyzer", *argv], cwd=checkout, env=env,
                          capture_output=True)  # fmt: skip
    out = PLOTLY_ID.sub(b"<plotly-id>", done.stdout)
    return out + f"\n[exit {done.returncode}]\n".encode()


def same_samples(before: str, keep: str | None) -> int:
    """Compare every output of :func:`sample_commands` between ``before`` and this checkout."""
    differ = []
    for name, argv in sample_commands():
        outs = {"before": output_of(before, argv), "now": output_of(ROOT, argv)}
        if keep:
            for side, data in outs.items():
                os.makedirs(os.path.join(keep, side), exist_ok=True)
                with open(os.path.join(keep, side, name), "wb") as fh:
                    fh.write(data)
        same = outs["before"] == outs["now"]
        print(f"{'same' if same else 'DIFFERS':>7}  {name}", flush=True)
        if not same:
            differ.append(name)
    print(f"\n{len(differ)} of {len(sample_commands())} outputs differ")
    return 1 if differ else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the git revision to compare against")
    ap.add_argument("--run", help="run directory (default: the 12,288-rank benchmark run)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--samples",
        action="store_true",
        help="compare the bytes of every report over samples/ and tests/data/cpu_runs",
    )
    ap.add_argument("--keep", help="with --samples: write both versions' outputs under KEEP")
    args = ap.parse_args()
    if args.samples:
        with tempfile.TemporaryDirectory(prefix="megascope-before-") as tmp:
            before = os.path.join(tmp, "checkout")
            subprocess.run(["git", "worktree", "add", "-q", "--detach", before, args.before],
                           cwd=ROOT, check=True)  # fmt: skip
            try:
                return same_samples(before, args.keep)
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", before], cwd=ROOT,
                               check=False)  # fmt: skip
    run = args.run or ensure_run(
        "dp=192,pp=8,tp=8", 50, os.path.join(DATA, "scale-dp192-pp8-tp8-50")
    )
    with tempfile.TemporaryDirectory(prefix="megascope-before-") as tmp:
        before = os.path.join(tmp, "checkout")
        subprocess.run(["git", "worktree", "add", "-q", "--detach", before, args.before],
                       cwd=ROOT, check=True)  # fmt: skip
        try:
            times: dict[str, list[float]] = {"before": [], "now": []}
            reports: dict[str, dict] = {}
            for k in range(args.rounds):
                order = ("before", "now") if k % 2 == 0 else ("now", "before")
                for name in order:
                    rep, took = analyze(before if name == "before" else ROOT, run)
                    times[name].append(took)
                    reports[name] = rep
                    print(f"round {k + 1} {name:>6}: {took:6.1f} s", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", before], cwd=ROOT, check=False)
    same = essence(reports["before"]) == essence(reports["now"])
    b, n = statistics.median(times["before"]), statistics.median(times["now"])
    print(f"\nfindings the same: {same}")
    for name in ("before", "now"):
        print(f"  {name:>6}: {essence(reports[name])}")
    print(f"median wall time: before {b:.1f} s, now {n:.1f} s, now/before {n / b:.3f}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
