"""One module per `megascope` verb, each with ``main(argv) -> int``; and the output options the
verbs that write a report share (``--json``, ``--out FILE``, ``--format``)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from tracer.cliutil import write_out

FORMATS = ("text", "json", "markdown", "html")
_BY_EXTENSION = {
    ".json": "json",
    ".md": "markdown",
    ".html": "html",
    ".htm": "html",
    ".txt": "text",
}


def add_output_args(p: argparse.ArgumentParser) -> None:
    """``--json``, ``--out FILE`` and ``--format`` on a report's command."""
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--out", metavar="FILE", help="write the report to FILE")
    p.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="output format (default: from --out's extension, else text)",
    )


def output_format(args: argparse.Namespace) -> str:
    """The format asked for: ``--format``, else JSON with ``--json``, else by ``--out``'s
    extension, else text."""
    fmt = args.format or ("json" if args.json else None)
    if fmt is None and args.out:
        fmt = _BY_EXTENSION.get(os.path.splitext(args.out)[1].lower())
    return fmt or "text"


def emit(args: argparse.Namespace, report: dict[str, Any], text: str) -> None:
    """Write the rendered ``text`` to ``--out`` (and with ``--json`` the report as JSON to
    stdout too), else print it."""
    if args.out:
        write_out(args.out, text)
        if args.json:
            from analyzer.render.findings import render_json

            sys.stdout.write(render_json(report))
    else:
        sys.stdout.write(text)
