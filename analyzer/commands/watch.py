"""``megascope watch RUN``: follow a running run and say when a finding appears or clears.

Every ``--interval`` seconds the run is read again (the tracer flushes every few steps) and the
detectors of ``megascope analyze`` run over its newest ``--window`` complete steps. Past 1,024
ranks, where that full look takes seconds, a look in between reads only the digests of the steps
it has not read (analyzer/pulse.py): the metrics follow every step, and the detectors run again
every ``--full-every`` seconds, as soon as the pulse's screen names a rank it did not name
before, and when the run ends. A finding
that appears prints a ``+`` line, one that is gone prints a ``-`` line, and ``--exec CMD`` runs
CMD for each (with ``MEGASCOPE_EVENT`` appeared|cleared, ``MEGASCOPE_KIND``, ``MEGASCOPE_RANKS``,
``MEGASCOPE_SEVERITY``, ``MEGASCOPE_MESSAGE``, ``MEGASCOPE_STEPS`` in its environment).
``--metrics-port`` also serves Prometheus metrics (prometheus-client) on 127.0.0.1 unless
``--metrics-host`` says otherwise: step time, per-rank compute, active findings by kind.

Exit status: once run.json says the run ended (or after one look with ``--once``): 0 when no
finding is active, 3 when some is (as ``analyze --fail-on-findings``), 2 with one line on
unusable input, 130 on Ctrl-C.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from analyzer.commands.analyze import EXIT_FINDINGS
from analyzer.findings import FINDING_KINDS
from tracer.cliutil import ArgumentParser, UsageError, log_warnings
from tracer.schema import RUN_STATUSES

ENDED = tuple(s for s in RUN_STATUSES if s != "running")
WINDOW = 20  # newest complete steps analyzed (--window); the dashboard's live mode too
FULL_EVERY = 60.0  # seconds between full looks past EXACT_MAX_RANKS ranks (--full-every)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="megascope watch", description=__doc__.splitlines()[0])
    p.add_argument("run", metavar="RUN", help="run directory (may not exist yet)")
    p.add_argument("--window", type=int, default=WINDOW, help="newest complete steps analyzed")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between looks")
    p.add_argument("--exec", dest="exec_cmd", metavar="CMD", help="run CMD on each change")
    p.add_argument("--once", action="store_true", help="look once and exit")
    p.add_argument("--wait", type=float, default=600.0,
                   help="seconds to wait for the run to start")  # fmt: skip
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--no-whatif", action="store_true", help="detectors' severity estimates")
    p.add_argument("--full-every", type=float, metavar="S",
                   help="seconds between full looks; between them a look reads the new steps' "
                   f"digests only (default: every look up to 1,024 ranks, {FULL_EVERY:g} past)")  # fmt: skip
    return p


@dataclass
class Look:
    """One look at the run: its status, the steps analyzed, the findings, the numbers."""

    status: str
    steps: tuple[int, int] | None = None
    findings: list[dict[str, Any]] = field(default_factory=list)
    step_s: float | None = None
    compute_s: dict[int, float] = field(default_factory=dict)


def look(run_dir: str, window: int, whatif: bool) -> Look | None:
    """The run's newest ``window`` complete steps analyzed (nothing until there are that many
    past the warm-up); None while nothing is readable, or when the tracer merged files away
    while they were being read (the next look reads the merged ones)."""
    import duckdb

    from analyzer.db import RunError, open_run
    from tracer.rundir import read_run_json

    try:
        status = str(read_run_json(run_dir).get("status", "running"))
        run = open_run(run_dir)
    except (RunError, ValueError, OSError, duckdb.Error):
        return None
    try:
        return _analyze(run, status, window, whatif)
    except (RunError, OSError, duckdb.Error):
        return None
    finally:
        run.close()


def live_steps(run: Any, window: int) -> tuple[int, int] | None:
    """The newest ``window`` complete steps past the warm-up, or None while there are fewer:
    what a look analyzes (the dashboard's live mode reads the same)."""
    from analyzer.findings import step_window

    lo, hi = step_window(run, None)
    return (hi - window + 1, hi) if hi - lo + 1 >= window else None


def _analyze(run: Any, status: str, window: int, whatif: bool) -> Look:
    from analyzer.findings import analyze
    from analyzer.findings.common import EXACT_MAX_RANKS

    steps = live_steps(run, window)
    if steps is None:
        return Look(status)
    report = analyze(run, steps=steps, whatif=whatif)
    exact = run.world_size <= EXACT_MAX_RANKS  # else from the digests, not every raw row
    name = "findings/rank_compute" if exact else "findings/rank_compute_digest"
    per_rank = run.query(name, lo=steps[0], hi=steps[1])
    med = report["run"].get("median_step_ms")
    return Look(
        status,
        steps,
        report["findings"],
        med / 1e3 if med is not None else None,
        {int(r): float(s) for r, s in zip(per_rank["rank"], per_rank["s"], strict=True)},
    )


def _key(f: dict[str, Any]) -> tuple[str, tuple[int, ...]]:
    return f["kind"], tuple(f["ranks"])


def _ranks(ranks: tuple[int, ...]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" (+{len(ranks) - 8})" if len(ranks) > 8 else "")


class Metrics:
    """The Prometheus series, served from a thread of prometheus-client."""

    def __init__(self, host: str, port: int) -> None:
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        self.registry = CollectorRegistry()
        self.step = Gauge("megascope_step_seconds", "median step time in the window",
                          registry=self.registry)  # fmt: skip
        self.last = Gauge("megascope_last_step", "newest complete step", registry=self.registry)
        self.compute = Gauge("megascope_rank_compute_seconds", "median compute per step",
                             ["rank"], registry=self.registry)  # fmt: skip
        self.findings = Gauge("megascope_findings", "active findings", ["kind"],
                              registry=self.registry)  # fmt: skip
        self.mfu = Gauge("megascope_mfu", "model FLOPs utilization (run.json)",
                         registry=self.registry)  # fmt: skip
        for kind in FINDING_KINDS:
            self.findings.labels(kind=kind).set(0)
        start_http_server(port, addr=host, registry=self.registry)

    def update(self, seen: Look, mfu: float | None) -> None:
        if seen.steps is not None:
            self.last.set(seen.steps[1])
        if seen.step_s is not None:
            self.step.set(seen.step_s)
        for rank, s in seen.compute_s.items():
            self.compute.labels(rank=str(rank)).set(s)
        counts = {kind: 0 for kind in FINDING_KINDS}
        for f in seen.findings:
            counts[f["kind"]] = counts.get(f["kind"], 0) + 1
        for kind, n in counts.items():
            self.findings.labels(kind=kind).set(n)
        if mfu is not None:
            self.mfu.set(mfu)


def _announce(
    event: str, f: dict[str, Any], steps: tuple[int, int] | None, cmd: str | None
) -> None:
    span = f"steps {steps[0]}-{steps[1]}" if steps else "steps -"
    kind, ranks = _key(f)
    stamp = time.strftime("%H:%M:%S")
    if event == "appeared":
        line = f"{stamp} {span}: + {kind} {_ranks(ranks)} ({f['severity']:.1%}): {f['message']}"
    else:
        line = f"{stamp} {span}: - {kind} {_ranks(ranks)} cleared"
    print(line, flush=True)
    if cmd:
        env = {**os.environ, "MEGASCOPE_EVENT": event, "MEGASCOPE_KIND": kind,
               "MEGASCOPE_RANKS": ",".join(map(str, ranks)),
               "MEGASCOPE_SEVERITY": f"{f['severity']:.4f}", "MEGASCOPE_MESSAGE": f["message"],
               "MEGASCOPE_STEPS": span.removeprefix("steps ")}  # fmt: skip
        done = subprocess.run(cmd, shell=True, env=env, check=False)
        if done.returncode != 0:
            print(f"{stamp} --exec exited {done.returncode}", file=sys.stderr, flush=True)


class Looks:
    """Full looks, and pulses in between where the run has digests and is large (see the
    module docstring)."""

    def __init__(self, args: Any) -> None:
        from analyzer.pulse import Pulse

        self.args = args
        self.pulse = Pulse(args.run)
        self.last_full: float | None = None
        self.screened: frozenset[int] = frozenset()  # the screen's ranks a full look has seen

    def next(self, active: list[dict[str, Any]]) -> Look | None:
        from analyzer.findings.common import EXACT_MAX_RANKS

        args, now = self.args, time.monotonic()
        beat = self.pulse.look(args.window)
        every = args.full_every
        if every is None:
            every = 0.0 if beat is None or beat.world <= EXACT_MAX_RANKS else FULL_EVERY
        full = (
            beat is None
            or beat.steps is None
            or self.last_full is None
            or now - self.last_full >= every
            or beat.status in ENDED
            or args.once
            or bool(beat.suspects - self.screened)
        )
        if not full:
            assert beat is not None  # no beat means a full look
            self.screened &= beat.suspects
            return Look(beat.status, beat.steps, active, beat.step_s, beat.compute_s)
        seen = look(args.run, args.window, not args.no_whatif)
        if seen is not None:
            self.last_full = now
            self.screened = beat.suspects if beat is not None else frozenset()
        return seen

    def close(self) -> None:
        self.pulse.close()


def watch(args: Any) -> int:
    looks = Looks(args)
    try:
        return _follow(args, looks)
    finally:
        looks.close()


def _follow(args: Any, looks: Looks) -> int:
    from tracer.rundir import mark_watched, read_run_json

    metrics = Metrics(args.metrics_host, args.metrics_port) if args.metrics_port else None
    print(f"watching {args.run}: the newest {args.window} steps every {args.interval:g} s",
          flush=True)  # fmt: skip
    active: dict[tuple[str, tuple[int, ...]], dict[str, Any]] = {}
    deadline = time.monotonic() + args.wait
    while True:
        if not args.once:
            mark_watched(args.run)  # its tracer keeps the configured flush interval
        seen = looks.next(list(active.values()))
        if seen is None:
            if args.once or time.monotonic() > deadline:
                raise UsageError(f"{args.run}: no run to watch (no run.json or no readable rows)")
            time.sleep(args.interval)
            continue
        now = {_key(f): f for f in seen.findings}
        for key, f in now.items():
            if key not in active:
                _announce("appeared", f, seen.steps, args.exec_cmd)
        for key, f in active.items():
            if key not in now:
                _announce("cleared", f, seen.steps, args.exec_cmd)
        active = now
        if metrics is not None:
            try:
                mfu = (read_run_json(args.run).get("summary") or {}).get("mfu")
            except (ValueError, OSError):
                mfu = None
            metrics.update(seen, mfu)
        if args.once or seen.status in ENDED:
            ended = "" if args.once else f"run {seen.status}; "
            print(f"{ended}{len(active)} finding(s) active", flush=True)
            return EXIT_FINDINGS if active else 0
        time.sleep(args.interval)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.window < 2:
        raise UsageError("--window must be at least 2 steps")
    if args.interval <= 0:
        raise UsageError("--interval must be > 0")
    if args.full_every is not None and args.full_every < 0:
        raise UsageError("--full-every must be >= 0")
    log_warnings()
    logging.getLogger("analyzer.db").setLevel(logging.ERROR)  # parts merged while read: retried
    try:
        return watch(args)
    except KeyboardInterrupt:
        return 130
    except OSError as e:  # the metrics port taken, say
        raise UsageError(f"cannot watch: {e}") from None
