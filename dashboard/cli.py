"""``megascope dashboard RUN_OR_ROOT [--host 127.0.0.1] [--port 8050]``."""

from __future__ import annotations

import ipaddress
import logging
import sys

from tracer.cliutil import ArgumentParser, UsageError

LOOPBACK = "127.0.0.1"


def _parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="megascope dashboard",
        description="serve the web dashboard for a run or a folder of runs",
    )
    p.add_argument(
        "run_or_root",
        metavar="RUN_OR_ROOT",
        help="a run directory, or a folder whose subfolders are runs",
    )
    p.add_argument(
        "--host", default=LOOPBACK, help="address to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--port", type=int, default=8050, help="port (default 8050)")
    p.add_argument("--debug", action="store_true", help="Dash debug mode (reloads, dev tools)")
    return p


def is_loopback(host: str) -> bool:
    """True for 'localhost' and loopback addresses; anything else is reachable from outside."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``megascope dashboard``: serves until stopped; returns the exit status."""
    args = _parser().parse_args(argv)
    if not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port}: expected 1..65535")
    from dashboard.app import create_app
    from dashboard.runs import RunPathError

    try:
        app = create_app(args.run_or_root)
    except RunPathError as e:
        raise UsageError(str(e)) from None
    if not is_loopback(args.host):
        print(
            f"megascope: warning: serving on {args.host}: anyone who can reach this address "
            "can read the run (there is no authentication)",
            file=sys.stderr,
        )
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    print(f"megascope dashboard: http://{args.host}:{args.port}/", flush=True)
    try:
        app.run(host=args.host, port=args.port, debug=args.debug)
    except OSError as e:
        raise UsageError(f"cannot serve on {args.host}:{args.port}: {e.strerror or e}") from None
    return 0
