"""``megascope analyze RUN``: the findings report (docs/spec.md §3, §4).

Exit status: 0 when the run could be read (3 with ``--fail-on-findings`` when there are
findings), 2 with a one-line reason on unusable input, never a traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

from tracer.cliutil import ArgumentParser, UsageError

log = logging.getLogger(__name__)

EXIT_FINDINGS = 3
_EXT_FORMATS = {".json": "json", ".md": "markdown", ".html": "html", ".htm": "html", ".txt": "text"}


def parse_steps(text: str | None) -> tuple[int, int] | None:
    """``A:B`` (inclusive); ``A:`` and ``:B`` leave one end open."""
    if text is None:
        return None
    lo, sep, hi = text.partition(":")
    try:
        a = int(lo) if lo.strip() else 0
        b = int(hi) if hi.strip() else 2**31 - 1
    except ValueError:
        raise UsageError(f"--steps {text!r}: expected A:B with integer steps") from None
    if not sep or a > b:
        raise UsageError(f"--steps {text!r}: expected A:B with A <= B")
    return a, b


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="megascope analyze", description=__doc__.splitlines()[0])
    p.add_argument("run", metavar="RUN", help="run directory")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--out", metavar="FILE", help="write the report to FILE")
    p.add_argument(
        "--format",
        choices=("text", "json", "markdown", "html"),
        default=None,
        help="output format (default: from --out's extension, else text)",
    )
    p.add_argument("--steps", metavar="A:B", help="analyze only steps A..B")
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
    return p


@contextlib.contextmanager
def _progress() -> Iterator[object]:
    """A rich status line on stderr when it is a terminal; otherwise nothing."""
    if not sys.stderr.isatty():
        yield lambda _msg: None
        return
    from rich.console import Console

    with Console(stderr=True).status("analyzing…") as status:
        yield lambda msg: status.update(f"analyzing: {msg}")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="megascope: warning: %(message)s")
    fmt = args.format or ("json" if args.json else None)
    if fmt is None and args.out:
        fmt = _EXT_FORMATS.get(os.path.splitext(args.out)[1].lower())
    fmt = fmt or "text"
    steps = parse_steps(args.steps)

    from analyzer.db import RunError, open_run
    from analyzer.findings import analyze
    from analyzer.report import render

    with _progress() as progress:
        progress("reading the run (one scan of its collectives and spans)…")
        try:
            run = open_run(args.run)
        except RunError as e:
            raise UsageError(str(e)) from None
        try:
            report = analyze(run, steps=steps, progress=progress, whatif=not args.no_whatif)  # type: ignore[arg-type]
            text = render(report, fmt, run)
        except Exception as e:  # a run we cannot read must not print a traceback
            log.debug("analysis failed", exc_info=True)
            first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
            raise UsageError(f"{args.run}: cannot analyze: {first}") from None
        finally:
            run.close()
    if args.out:
        try:
            with open(args.out, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            raise UsageError(f"--out {args.out}: {e.strerror or e}") from None
        if args.json:
            sys.stdout.write(render(report, "json"))
    else:
        sys.stdout.write(text)
    if args.fail_on_findings and report["findings"]:
        return EXIT_FINDINGS
    return 0
