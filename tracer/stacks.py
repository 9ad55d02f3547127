"""Ask the ranks of a running traced job for their stacks: ``python -m tracer.stacks RUN``.

Every attached tracer's watchdog watches ``RUN/dump-stacks``; touching it makes each rank take
a py-spy dump of itself into the ``stacks`` table (reason ``request``) and flush, which works
across hosts when the run directory is shared. ``--signal`` also sends SIGUSR1 to the ranks
that run on this host (pids from ``topology``), for a run directory the ranks cannot see
changing. ``--wait`` waits until every rank of ``topology`` has written new stacks.
"""

from __future__ import annotations

import glob
import os
import signal
import socket
import sys
import time

from tracer.cliutil import ArgumentParser, UsageError
from tracer.config import TracerConfig
from tracer.schema import rank_dir


def _ranks(run_dir: str) -> dict[int, tuple[str, int]]:
    """rank -> (host, pid) from the topology table (the latest row of each rank)."""
    import pyarrow.parquet as pq

    out: dict[int, tuple[str, int]] = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "topology", "*", "*.parquet"))):
        try:
            rows = pq.read_table(path, columns=["rank", "host", "pid"]).to_pylist()
        except Exception:  # a reader skips what it cannot read
            continue
        for row in rows:
            out[int(row["rank"])] = (str(row["host"]), int(row["pid"]))
    return out


def _stack_files(run_dir: str, rank: int) -> int:
    return len(glob.glob(os.path.join(rank_dir(run_dir, "stacks", rank), "*.parquet")))


def request(run_dir: str, *, use_signal: bool = False) -> list[int]:
    """Ask for stacks; returns the ranks signalled (on this host, with ``use_signal``)."""
    trigger = os.path.join(run_dir, TracerConfig().stacks_file)
    with open(trigger, "a", encoding="utf-8"):
        pass
    now = time.time()
    os.utime(trigger, (now, now))
    signalled = []
    if use_signal:
        host = socket.gethostname()
        for rank, (rank_host, pid) in sorted(_ranks(run_dir).items()):
            if rank_host == host:
                try:
                    os.kill(pid, signal.SIGUSR1)
                    signalled.append(rank)
                except ProcessLookupError:
                    pass
    return signalled


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m tracer.stacks``; returns the exit status."""
    parser = ArgumentParser(prog="python -m tracer.stacks", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="the run directory of a running traced job")
    parser.add_argument("--signal", action="store_true", help="also SIGUSR1 local ranks")
    parser.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the dumps")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.run):
        raise UsageError(f"{args.run}: not a directory")
    ranks = _ranks(args.run)
    if not ranks:
        raise UsageError(f"{args.run}: no topology rows (is a traced job running there?)")
    before = {r: _stack_files(args.run, r) for r in ranks}
    signalled = request(args.run, use_signal=args.signal)
    if signalled:
        print(f"signalled ranks {signalled}")
    deadline = time.monotonic() + args.wait
    pending = set(ranks)
    while pending and time.monotonic() < deadline:
        time.sleep(0.2)
        pending = {r for r in pending if _stack_files(args.run, r) <= before[r]}
    if args.wait:
        done = sorted(set(ranks) - pending)
        print(
            f"stacks from ranks {done}" + (f"; none yet from {sorted(pending)}" if pending else "")
        )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UsageError as e:
        print(f"python -m tracer.stacks: error: {e}", file=sys.stderr)
        sys.exit(2)
