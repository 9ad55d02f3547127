"""``megascope watch RUN``: follow a running run and say when a finding appears or clears.

As soon as every rank has written a step the last look did not read (the tracer flushes every
few steps), and ``--interval`` seconds after the last look at the latest (a hung run writes
none), the run is read again: a pulse reads the new steps' digests (analyzer/pulse.py), and a
rank that turned slow in them is named at once, three slow steps after its onset; the
detectors of ``megascope analyze`` then run over the newest ``--window`` complete steps (a
full look), which confirm it or take it back. Full looks come right after such a rank, when the
pulse's screen names a rank it did not name before, when the run ends, and otherwise at most
every five times what the last one took (every ``--full-every`` seconds past 1,024 ranks,
where one takes seconds); they run in a process of their own, so the pulse follows every step
meanwhile, and the metrics with it (:mod:`analyzer.live`). A finding
that appears prints a ``+`` line, one that is gone prints a ``-`` line, and ``--exec CMD`` runs
CMD for each (with ``MEGASCOPE_EVENT`` appeared|cleared, ``MEGASCOPE_KIND``, ``MEGASCOPE_RANKS``,
``MEGASCOPE_SEVERITY``, ``MEGASCOPE_MESSAGE``, ``MEGASCOPE_STEPS`` in its environment).
While it follows a run, a watch keeps a marker in the run directory (``.watching``: its host
and pid, touched every second; :class:`analyzer.live.WatchMarker`), and the run's tracers, which
read it at each flush, write each step as it ends (at most every 0.5 s; tracer/budget.py),
so that a look reads a step as soon as every rank closed it.
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
from typing import Any

from analyzer.commands.analyze import EXIT_FINDINGS
from analyzer.findings.record import Finding
from analyzer.live import ENDED, FULL_EVERY, WINDOW, Looks, Metrics, WatchMarker, finding_key
from analyzer.trackers import TrackerFeed, add_tracker_args, open_tracker
from tracer.cliutil import ArgumentParser, UsageError, log_warnings


def build_parser() -> ArgumentParser:
    """The arguments of ``megascope watch``."""
    p = ArgumentParser(prog="megascope watch", description=__doc__.splitlines()[0])
    p.add_argument("run", metavar="RUN", help="run directory (may not exist yet)")
    p.add_argument("--window", type=int, default=WINDOW, help="newest complete steps analyzed")
    p.add_argument("--interval", type=float, default=5.0,
                   help="seconds between looks while no new step is complete")  # fmt: skip
    p.add_argument("--exec", dest="exec_cmd", metavar="CMD", help="run CMD on each change")
    p.add_argument("--once", action="store_true", help="look once and exit")
    p.add_argument("--wait", type=float, default=600.0,
                   help="seconds to wait for the run to start")  # fmt: skip
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--no-whatif", action="store_true", help="detectors' severity estimates")
    p.add_argument("--full-every", type=float, metavar="S",
                   help="seconds between full looks; between them a look reads the new steps' "
                   "digests only (default: five times what the last took up to 1,024 ranks, "
                   f"{FULL_EVERY:g} past)")  # fmt: skip
    add_tracker_args(p)
    return p


def _ranks(ranks: tuple[int, ...]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" (+{len(ranks) - 8})" if len(ranks) > 8 else "")


def _announce(event: str, f: Finding, steps: tuple[int, int] | None, cmd: str | None) -> None:
    span = f"steps {steps[0]}-{steps[1]}" if steps else "steps -"
    kind, ranks = finding_key(f)
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


class Gaps:
    """Says once, as a warning line, which ranks' folders the run is missing (a rank folder
    removed under a running run, a rank that never wrote): the findings stand on the rest. While
    the run trains, a gap is said once two looks in a row see it (a rank's first flush may come
    a little after its peers'); on the last look at once."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.seen: str | None = None  # the gap the last look saw
        self.said: str | None = None

    def say(self, final: bool) -> None:
        """Look at the run's folders; print the gap where it is new and stands."""
        from analyzer.parts import missing_line
        from tracer.rundir import read_run_json

        try:
            world = read_run_json(self.run_dir).get("world_size")
        except (ValueError, OSError):
            return
        gap = missing_line(self.run_dir, world) if isinstance(world, int) else None
        if gap is not None and gap != self.said and (final or gap == self.seen):
            logging.getLogger("megascope.watch").warning("%s", gap)
            self.said = gap
        self.seen = gap


def watch(args: Any) -> int:
    """Follow the run with the parsed ``args`` (the module docstring); returns the exit status."""
    feed = open_tracker(args, args.run)  # --log-to: each look's findings and new steps
    looks = Looks(args.run, args.window, whatif=not args.no_whatif, once=args.once,
                  full_every=args.full_every, background=not args.once)  # fmt: skip
    marker = None if args.once else WatchMarker(args.run)  # its tracers write each step
    try:
        return _follow(args, looks, marker, feed)
    finally:
        if marker is not None:
            marker.stop()
        looks.close()
        if feed is not None:
            feed.close()


def _follow(args: Any, looks: Looks, marker: WatchMarker | None, feed: TrackerFeed | None) -> int:
    from tracer.rundir import read_run_json

    metrics = Metrics(args.metrics_host, args.metrics_port) if args.metrics_port else None
    print(f"watching {args.run}: the newest {args.window} steps at each new step "
          f"(every {args.interval:g} s without one)", flush=True)  # fmt: skip
    active: dict[tuple[str, tuple[int, ...]], Finding] = {}
    deadline = time.monotonic() + args.wait
    gaps = Gaps(args.run)
    while True:
        seen = looks.next(list(active.values()))
        if seen is not None:
            gaps.say(final=args.once or seen.status in ENDED)
        if marker is not None and seen is not None and seen.status in ENDED:
            marker.stop()
        if seen is None:
            if args.once or time.monotonic() > deadline:
                raise UsageError(f"{args.run}: no run to watch (no run.json or no readable rows)")
            time.sleep(args.interval)
            continue
        now = {finding_key(f): f for f in seen.findings}
        for key, f in now.items():
            if key not in active:
                _announce("appeared", f, seen.steps, args.exec_cmd)
        for key, f in active.items():
            if key not in now:
                _announce("cleared", f, seen.steps, args.exec_cmd)
        active = now
        if feed is not None:
            feed.look(args.run, seen.findings, seen.steps)
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
        looks.wait(args.interval)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``megascope watch``; returns the exit status."""
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
