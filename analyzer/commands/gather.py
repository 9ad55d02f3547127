"""``megascope gather SRC... --out RUN``: one run from the run directories of several nodes.

A run over several nodes whose ``--out`` was on each node's local disk leaves one partial run
directory per node: node 0's holds run.json, rank 0's progress and its ranks' tables, node K's
its own ranks' tables and its launch's claim and outcome (``.progress/node-KKKKK.json``). Copy
or mount those folders where one machine sees them, or name them by URL (``s3://``, ``gs://``,
``hdfs://``: whatever pyarrow's file systems read, with their usual credentials), and gather:

    megascope gather /mnt/node0/runs/big /mnt/node1/runs/big --out runs/big
    megascope gather s3://bucket/runs/big --out runs/big      # a run kept in an object store

Every file is copied once: a path that two sources hold with different sizes was written by two
nodes and is refused (one line, exit 2; the same file seen twice, e.g. a shared folder named
twice, is copied once). Checkpoints are left out unless ``--checkpoints``. The result is
written beside ``--out`` and renamed into place, then its run.json gets the status of every
node whose outcome was found (:func:`tracer.rundir.combined_status`), ``nodes`` (each node's
own) and ``summary.ranks_reporting``; ``gathered_from`` names the sources.
"""

from __future__ import annotations

from analyzer.gather import gather
from tracer.cliutil import ArgumentParser, UsageError


def build_parser() -> ArgumentParser:
    """The arguments of ``megascope gather``."""
    p = ArgumentParser(prog="megascope gather", description=__doc__.splitlines()[0])
    p.add_argument(
        "sources", metavar="SRC", nargs="+", help="run directories or URLs, one per node"
    )
    p.add_argument("--out", required=True, metavar="RUN", help="the run directory to make")
    p.add_argument("--checkpoints", action="store_true", help="copy the checkpoints too")
    return p


def main(argv: list[str]) -> int:
    """Entry point of ``megascope gather``; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        res = gather(args.sources, args.out, checkpoints=args.checkpoints)
    except OSError as e:
        raise UsageError(f"{getattr(e, 'filename', None) or args.out}: {e.strerror or e}") from None
    print(
        f"gathered {res['files']} files ({res['bytes'] / 2**20:.1f} MiB) from "
        f"{len(args.sources)} sources into {res['out']} in {res['seconds']:.1f} s: "
        f"status {res['status']}"
    )
    return 0
