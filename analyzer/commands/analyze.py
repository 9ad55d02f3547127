"""``megascope analyze RUN``: the findings report (docs/spec.md §3, §4).

Exit status: 0 when the run could be read (3 with ``--fail-on-findings`` when there are
findings), 2 with a one-line reason on unusable input, never a traceback.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any, cast

from analyzer.commands import add_output_args, emit, output_format
from analyzer.trackers import TrackerFeed, add_tracker_args, open_tracker
from tracer.cliutil import ArgumentParser, UsageError, log_warnings, parse_steps

log = logging.getLogger(__name__)

EXIT_FINDINGS = 3


def build_parser() -> ArgumentParser:
    """The arguments of ``megascope analyze``."""
    p = ArgumentParser(prog="megascope analyze", description=__doc__.splitlines()[0])
    p.add_argument("run", metavar="RUN", help="run directory")
    add_output_args(p)
    p.add_argument("--steps", metavar="A:B", help="analyze only steps A..B")
    p.add_argument("--last", type=int, metavar="N", help="analyze only the last N steps")
    p.add_argument(
        "--windows",
        type=int,
        metavar="K",
        help="findings per window of K steps and a timeline of each fault (JSON or text)",
    )
    p.add_argument(
        "--engine",
        choices=("local", "dask"),
        default="local",
        help="local: this process (default); dask: the digests and windows as Dask tasks",
    )
    p.add_argument(
        "--scheduler", metavar="ADDR", help="a running Dask scheduler (default: a local cluster)"
    )
    p.add_argument(
        "--workers", type=int, metavar="N", help="workers of the local Dask cluster (default 2)"
    )
    p.add_argument(
        "--no-whatif",
        action="store_true",
        help="severities from each detector's estimate, without the what-if replay (faster)",
    )
    p.add_argument(
        "--fail-on-findings",
        action="store_true",
        help=f"exit {EXIT_FINDINGS} when there are findings",
    )
    add_tracker_args(p)
    return p


@contextlib.contextmanager
def _progress() -> Iterator[Callable[[str], None]]:
    """A rich status line on stderr when it is a terminal; otherwise nothing."""
    if not sys.stderr.isatty():
        yield lambda _msg: None
        return
    from rich.console import Console

    with Console(stderr=True).status("analyzing…") as status:
        yield lambda msg: status.update(f"analyzing: {msg}")


def main(argv: list[str]) -> int:
    """Entry point of ``megascope analyze``; returns the exit status."""
    args = build_parser().parse_args(argv)
    log_warnings()
    fmt = output_format(args)
    steps = parse_steps(args.steps)
    _check_window_args(args, steps, fmt)

    # --log-to: the tracker's run opened first (a missing extra or an unknown run says so
    # before the analysis), the report's findings and per-step scores logged to it at the end
    feed = open_tracker(args, args.run)
    try:
        report, text = _analyze(args, steps, fmt, feed)
    finally:
        if feed is not None:
            feed.close()
    emit(args, report, text)
    found = report["findings"] if "findings" in report else report["timeline"]
    if args.fail_on_findings and found:
        return EXIT_FINDINGS
    return 0


def _analyze(args, steps, fmt: str, feed: TrackerFeed | None) -> tuple[dict, str]:
    """Open the run, analyze it, log to ``feed``: the report and its rendering."""
    from analyzer.db import RunError, open_run
    from analyzer.executor import digests_hook, make_engine

    with _progress() as progress, make_engine(args.engine, args.scheduler, args.workers) as engine:
        progress("reading the run (one scan of its collectives and spans)…")
        hook = digests_hook(engine) if engine.name != "local" else None
        try:
            run = open_run(args.run, digests=hook)
        except RunError as e:
            raise UsageError(str(e)) from None
        try:
            try:
                report, text = _report(run, args, steps, fmt, engine, progress)
            except Exception as e:  # a run we cannot read must not print a traceback
                log.debug("analysis failed", exc_info=True)
                first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
                raise UsageError(f"{args.run}: cannot analyze: {first}") from None
            if feed is not None:
                progress(f"logging to {args.log_to}…")
                found = report["findings"] if "findings" in report else report["timeline"]
                span = report["run"].get("steps")
                feed.report(run, found, (int(span[0]), int(span[1])) if span else None)
        finally:
            run.close()
    return report, text


def _check_window_args(args, steps: tuple[int, int] | None, fmt: str) -> None:
    if args.last is not None and (args.last < 1 or steps is not None):
        raise UsageError("--last N: N >= 1, and not with --steps")
    if args.windows is not None and args.windows < 1:
        raise UsageError(f"--windows {args.windows}: expected K >= 1 steps per window")
    if args.windows is not None and fmt not in ("json", "text"):
        raise UsageError("--windows prints JSON or text")


def _report(run, args, steps, fmt: str, engine, progress) -> tuple[dict, str]:
    """The report (windows, or one over the steps asked for) and its rendering."""
    from analyzer.findings import analyze
    from analyzer.render.findings import render, render_json
    from analyzer.render.windows import render_windows
    from analyzer.windows import analyze_windows, last_steps

    if args.last is not None:
        steps = last_steps(run, args.last)
    whatif = not args.no_whatif
    if args.windows is not None:
        report = analyze_windows(run, args.windows, engine, steps=steps, whatif=whatif)
    else:
        findings = analyze(run, steps=steps, progress=progress, whatif=whatif)
        report = cast("dict[str, Any]", findings)  # leaves as the JSON object it is
    if engine.name != "local":
        report["engine"] = engine.report()
    if args.windows is not None:
        return report, render_json(report) if fmt == "json" else render_windows(report)
    return report, render(findings, fmt, run)
