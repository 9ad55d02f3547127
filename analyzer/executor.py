"""The analysis executor: where the analysis runs, in this process or on Dask distributed.

The pattern is smallpond's: each partition of a run (a group of its rank or rank-range
folders) is read by its own DuckDB with the same ``.sql`` files, and the engine only
schedules. :func:`digests_hook` returns the hook :func:`analyzer.db.open_run` takes: it cuts the
run's collectives and spans into partitions (:func:`partitions`), computes each partition's
digests as one task (:data:`PARTITION_DIGEST`, one call to analyzer/digests.py's
``digest_tables``: digest_collectives and digest_spans are keyed by rank, so the partitions'
rows only need to be put together), and records each task's time and rows in
``engine.tasks``. A run whose digests are stored (written at the source, or cached by an
earlier analysis) needs no scan: ``open_run`` reads them. The driver then matches the suspect
groups and replays the what-if as the embedded engine does. Windows
(analyzer/windows.py) and the runs of a fleet (analyzer/fleet.py) are tasks on it too.

* :class:`LocalEngine`: tasks run one after another in this process (``--engine local``,
  the default; the digests are then made by the run's own connection, as before).
* :class:`DaskEngine`: ``Client(ADDR)`` of a running scheduler (``dask scheduler`` /
  ``dask worker``, dask-jobqueue, Kubernetes), else a ``LocalCluster`` whose scheduler,
  workers and nannies listen on 127.0.0.1 only, without a dashboard. Dask is the optional
  extra ``megascope[dask]``, imported only here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from analyzer.db import DIGESTS, Run
from analyzer.digests import CACHE, digest_tables, stored_allowed
from analyzer.duck import connect
from analyzer.parts import parts_in, rank_folders
from tracer.cliutil import UsageError
from tracer.rundir import folder_ranks

ENGINES = ("local", "dask")
TASKS_PER_WORKER = 4  # partitions per worker thread: some balance, few DuckDB start-ups


@dataclass
class Partition:
    """A contiguous range of ranks and the parts of each digested table that hold them."""

    index: int
    ranks: tuple[int, int]
    files: dict[str, list[str]]


def _folder_span(folder: str) -> tuple[int, int] | None:
    return folder_ranks(os.path.basename(folder))


def partitions(run: Run, n: int) -> list[Partition]:
    """The run's collectives and spans cut into at most ``n`` partitions of whole folders.

    Folders whose rank ranges overlap (a run holding both ``rank=`` and ``ranks=`` folders of
    one rank) go to the same partition, so a rank's rows are digested in one task."""
    folders: list[tuple[int, int, str, str]] = []
    for table in DIGESTS:
        for folder in rank_folders(run.path, table):
            span = _folder_span(folder)
            if span is not None:
                folders.append((span[0], span[1], table, folder))
    folders.sort()
    units: list[list[tuple[int, int, str, str]]] = []
    hi = -1
    for f in folders:  # union of overlapping rank ranges, across both tables
        if units and f[0] <= hi:
            units[-1].append(f)
        else:
            units.append([f])
        hi = max(hi, f[1])
    if not units:
        return []
    n = max(1, min(n, len(units)))
    out: list[Partition] = []
    for i in range(n):
        chunk = units[len(units) * i // n : len(units) * (i + 1) // n]
        flat = [f for unit in chunk for f in unit]
        files = {t: parts_in(f[3] for f in flat if f[2] == t) for t in DIGESTS}
        files = {t: [p for p in fs if p not in run.skipped] for t, fs in files.items()}
        out.append(Partition(i, (flat[0][0], max(f[1] for f in flat)), files))
    return out


def digest_partition(part: Partition, threads: int = 1) -> dict[str, Any]:
    """One task: the digests of ``part``'s raw parts, in its own DuckDB, by the digests
    module's :func:`~analyzer.digests.digest_tables` (the same .sql files as ``open_run``).

    Returns the tables (``collectives``, ``spans``) and the task's record: its ranks, files,
    rows read (the digests' ``n_rows``), rows made, seconds and process."""
    t0 = time.perf_counter()
    con = connect(threads=threads)
    try:
        tables = digest_tables(part.files["collectives"], part.files["spans"], con=con)
    finally:
        con.close()
    rows_in = {t: int(pc.sum(tb["n_rows"]).as_py() or 0) for t, tb in tables.items()}
    record = {
        "task": part.index,
        "ranks": list(part.ranks),
        "files": sum(len(f) for f in part.files.values()),
        "rows_in": rows_in,
        "rows_out": {t: tb.num_rows for t, tb in tables.items()},
        "seconds": round(time.perf_counter() - t0, 4),
        "pid": os.getpid(),
    }
    return {"tables": tables, "record": record}


# The per-partition step, one call: a task's whole work, swappable (a partition, threads ->
# {"tables", "record"}), e.g. for one that reads a partition's stored digests instead.
PARTITION_DIGEST: Callable[..., dict[str, Any]] = digest_partition


@dataclass
class Engine:
    """Runs tasks; ``tasks`` keeps each digest task's record, ``info`` what the report shows."""

    name: str = "local"
    workers: int = 1
    threads: int = 1
    tasks: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def map(self, fn: Callable[..., Any], items: Iterable[Any], **kw: Any) -> list[Any]:
        """``fn(item, **kw)`` for each item, in order, in this process."""
        return [fn(item, **kw) for item in items]

    def close(self) -> None:
        """Nothing to release for the local engine."""
        pass

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def report(self) -> dict[str, Any]:
        """The ``engine`` key of a report: the engine, its workers and every task's record."""
        return {"name": self.name, "workers": self.workers, **self.info, "tasks": self.tasks}


class LocalEngine(Engine):
    """Every task in this process, one after another."""

    pass


class DaskEngine(Engine):
    """A Dask client: of the scheduler at ``address``, else of a loopback LocalCluster."""

    def __init__(self, address: str | None = None, workers: int = 2, threads: int = 1) -> None:
        super().__init__(name="dask", workers=workers, threads=threads)
        try:
            import logging

            from distributed import Client, LocalCluster

            logging.getLogger("distributed").setLevel(logging.ERROR)
        except ImportError:
            raise UsageError(
                "--engine dask needs Dask distributed: pip install 'megascope[dask]'"
            ) from None
        t0 = time.perf_counter()
        self.cluster = None
        try:
            if address:
                self.client = Client(address, timeout="10s")
            else:
                self.cluster = LocalCluster(
                    host="127.0.0.1",
                    n_workers=workers,
                    threads_per_worker=threads,
                    processes=True,
                    dashboard_address=None,
                    silence_logs=logging.ERROR,
                )
                self.client = Client(self.cluster)
        except (OSError, TimeoutError) as e:
            self.close()
            first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
            raise UsageError(f"--scheduler {address}: cannot connect ({first})") from None
        self.workers = len(self.client.scheduler_info(n_workers=-1)["workers"]) or workers
        scheduler = self.client.scheduler
        assert scheduler is not None  # a connected client holds its scheduler's address
        self.info = {
            "scheduler": scheduler.address,
            "start_s": round(time.perf_counter() - t0, 3),
        }

    def map(self, fn: Callable[..., Any], items: Iterable[Any], **kw: Any) -> list[Any]:
        """``fn(item, **kw)`` for each item as Dask tasks; the results in the items' order."""
        items = list(items)
        futures = self.client.map(fn, items, pure=False, **kw)
        return self.client.gather(futures)

    def close(self) -> None:
        """Close the client, and the local cluster if this engine started one."""
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
        if self.cluster is not None:
            self.cluster.close()


def make_engine(name: str, scheduler: str | None = None, workers: int | None = None) -> Engine:
    """The engine ``--engine NAME`` asks for (``--scheduler`` implies dask)."""
    if scheduler and name != "dask":
        raise UsageError("--scheduler needs --engine dask")
    if workers is not None and (workers < 1 or name != "dask"):
        raise UsageError(f"--workers {workers}: a number >= 1, with --engine dask")
    if name == "local":
        return LocalEngine()
    if name == "dask":
        return DaskEngine(scheduler, workers=workers or min(2, os.cpu_count() or 1))
    raise UsageError(f"--engine {name!r}: expected one of {', '.join(ENGINES)}")


def digests_hook(engine: Engine, tasks: int | None = None) -> Callable[[Run], dict]:
    """The ``digests`` hook of :func:`analyzer.db.open_run` running on ``engine``."""

    def hook(run: Run) -> dict[str, pa.Table]:
        stored = run.has_rows("digests") or os.path.isfile(os.path.join(run.path, CACHE))
        if stored and stored_allowed():
            engine.info["digests"] = "stored"  # read by open_run: nothing to scan
            return {}
        t0 = time.perf_counter()
        n = tasks or TASKS_PER_WORKER * engine.workers * engine.threads
        parts = partitions(run, n)
        threads = max(1, (os.cpu_count() or 1) // max(1, engine.workers * engine.threads))
        results = engine.map(PARTITION_DIGEST, parts, threads=threads)
        made: dict[str, pa.Table] = {}
        for table in DIGESTS:
            pieces = [r["tables"][table] for r in results if r["tables"][table].num_rows]
            if pieces:
                made[table] = pa.concat_tables(pieces, promote_options="permissive")
        engine.tasks += [r["record"] for r in results]
        engine.info["digests"] = "tasks"
        engine.info["digest_s"] = round(time.perf_counter() - t0, 4)
        return made

    return hook
