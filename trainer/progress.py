"""What the launcher learns from its ranks, through small hidden files in the run directory.

``RUN/.progress/`` (a hidden folder: not a table, ignored by readers of the run):

* ``rank-RRRRR`` — one line ``pid step ns state``, rewritten atomically by rank R as it starts
  (``start``), when its model is built (``ready``) and after every step (``step``). The launcher
  only compares successive lines, so a rank whose line stops changing has stopped progressing.
  A rewrite is a ~40-byte write and a rename: cheap enough for every step.
* ``steps.jsonl`` — rank 0 appends ``{"step", "loss", "step_ms", "first"}`` per step; after
  a resume the later line for a step wins.
* ``model.json`` — rank 0's report of the built model (parameters, FLOPs per token, device).
* ``memory-RRRRR.json`` — rank R's accounting of its training state's memory after its first
  step (``trainer/memory.py``), gathered into run.json ``memory`` at the end.
* ``launch.json`` — the resolved configuration the launcher hands to the ranks.

It also holds the launcher's py-spy stack capture for ranks that could not record their own,
and the run summary computed from ``steps.jsonl``.

A rank writes through its :class:`ProgressWriter`, which hands every write to a thread of its
own, so a stalled disk (a hung NFS mount, a saturated disk) never holds a step: the newest line
replaces one not yet written, step records queue and are dropped with a count when the queue is
full. The first write that fails (the disk full, read-only, the folder gone, an I/O error) turns
it off with one line naming the path and the error, and the training goes on. The launcher does not take the silence that follows for a
hang: each progress line is also sent to it as a datagram (tracer/beacon.py), which lives on no
filesystem, together with the writer's failure (run.json ``storage_failed``).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tracer import beacon
from tracer.rundir import write_json_atomic, write_part
from tracer.schema import rank_dir


@dataclass(frozen=True)
class RankLine:
    """One ``rank-RRRRR`` line, parsed: pid, step, ns, state, and the line as read."""

    pid: int
    step: int
    ns: int
    state: str
    raw: str


def progress_dir(run_dir: str) -> str:
    """``RUN/.progress``."""
    return os.path.join(run_dir, ".progress")


def _rank_path(run_dir: str, rank: int) -> str:
    return os.path.join(progress_dir(run_dir), f"rank-{rank:05d}")


def write_rank(run_dir: str, rank: int, step: int, state: str) -> None:
    """Rank ``rank`` reports that it reached ``step`` in ``state`` (atomic rewrite)."""
    _write_line(_rank_path(run_dir, rank), f"{os.getpid()} {step} {time.time_ns()} {state}")


# step records the writer thread may owe before new ones are dropped (with a count)
STEP_QUEUE = 1024
# how long :meth:`ProgressWriter.close` waits for the last writes of a stalled disk
CLOSE_S = 2.0


@dataclass(frozen=True)
class Pending:
    """One file write handed to the writer thread: the file, the write, the step it belongs to."""

    path: str
    write: Callable[[], None]
    step: int


class ProgressWriter:
    """Rank ``rank``'s writes into ``RUN/.progress``, which never fail nor hold the training.

    The training thread only hands its writes over and goes on; a daemon thread of the writer
    does them. A file that is rewritten whole (the rank's line, ``model.json``, ``memory-R``)
    has a one-slot mailbox: progress is a state, so the newest line replaces one not yet
    written. Rank 0's step records (``steps.jsonl``) wait in a queue of ``queue`` records; while
    the disk stalls and the queue is full, a new record is dropped and counted (``dropped``).
    Every progress line also goes to the launcher at once, on the training thread
    (``beacon``, when one listens; a datagram never blocks), so a stalled disk does not make a
    progressing rank look hung. The first write that raises OSError turns the writer off:
    one line (:func:`tracer.beacon.off_line`), the failure sent to the launcher, and no write
    after it (the lines still go to the launcher). A checkpoint that cannot be written is said
    once per checkpoint (:meth:`checkpoint_missing`). :meth:`close` waits at most ``CLOSE_S``
    for the writes still owed.
    """

    def __init__(
        self,
        run_dir: str,
        rank: int,
        sender: beacon.Sender | None = None,
        queue: int = STEP_QUEUE,
    ) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.sender = sender if sender is not None else beacon.sender()
        self.failure: beacon.StorageFailure | None = None
        self.step = -1
        self.missing: list[int] = []  # checkpoints (steps done) that could not be written
        self.dropped = 0  # step records dropped while the queue was full
        self.queue = max(1, queue)
        self._cond = threading.Condition()
        self._latest: dict[str, Pending] = {}  # path -> the newest write of a whole file
        self._records: collections.deque[dict[str, Any]] = collections.deque()
        self._record_step = -1  # the step of the newest record queued
        self._busy = False  # the writer thread holds writes it has not finished
        self._closing = False
        self._thread: threading.Thread | None = None

    @property
    def on(self) -> bool:
        """Whether the writer still writes."""
        return self.failure is None

    def owed(self) -> int:
        """How many writes wait for the writer thread to take them (not those it is doing)."""
        with self._cond:
            return len(self._latest) + len(self._records)

    def _hand(self, job: Pending | None = None, record: dict[str, Any] | None = None) -> None:
        if self.failure is not None:
            return
        with self._cond:
            if self._closing:
                return
            if job is not None:
                self._latest.pop(job.path, None)
                self._latest[job.path] = job
            if record is not None:
                if len(self._records) >= self.queue:
                    self.dropped += 1
                    return
                self._records.append(record)
                self._record_step = self.step
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"megascope-progress-{self.rank}", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._latest or self._records or self._closing):
                    self._cond.wait()
                jobs = list(self._latest.values())
                self._latest.clear()
                if self._records:
                    records = list(self._records)
                    self._records.clear()
                    path = os.path.join(progress_dir(self.run_dir), "steps.jsonl")
                    jobs.insert(0, Pending(path, self._appender(records), self._record_step))
                if not jobs:  # closing, nothing owed
                    self._cond.notify_all()
                    return
                self._busy = True
            for job in jobs:
                if self.failure is None:
                    self.perform(job)
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _appender(self, records: list[dict[str, Any]]) -> Callable[[], None]:
        return lambda: append_steps(self.run_dir, records)

    def perform(self, job: Pending) -> None:
        """Do one write, on the writer thread; the first OSError turns the writer off."""
        try:
            job.write()
        except OSError as exc:
            self.failure = beacon.StorageFailure(
                self.rank, "progress", beacon.failed_path(exc, job.path), beacon.describe(exc),
                job.step,
            )  # fmt: skip
            logging.getLogger("megascope.rank").warning("%s", beacon.off_line(self.failure))
            self.sender.failure(self.failure)

    def flush(self, timeout: float = CLOSE_S) -> bool:
        """Wait at most ``timeout`` seconds until every write handed over is done (or the writer
        is off); returns whether it is."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._latest or self._records or self._busy) and self.failure is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout: float = CLOSE_S) -> bool:
        """No more writes: wait at most ``timeout`` seconds for those owed (a stalled disk is
        left to the daemon thread), say once how many step records were dropped; returns
        whether everything handed over was written."""
        done = self.flush(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self.dropped:
            logging.getLogger("megascope.rank").warning(
                "megascope: rank %d: %d step records not written to %s (the disk was too slow)",
                self.rank,
                self.dropped,
                os.path.join(progress_dir(self.run_dir), "steps.jsonl"),
            )
        return done and self.failure is None

    def rank_line(self, step: int, state: str) -> None:
        """This rank reached ``step`` in ``state``: its line, to the launcher and to disk."""
        self.step = max(self.step, step)
        raw = f"{os.getpid()} {step} {time.time_ns()} {state}"
        self.sender.line(self.rank, raw)
        path = _rank_path(self.run_dir, self.rank)
        self._hand(Pending(path, lambda: _write_line(path, raw), self.step))

    def step_record(self, record: dict[str, Any]) -> None:
        """Rank 0's record of a step (``steps.jsonl``)."""
        self._hand(record=record)

    def model_report(self, report: dict[str, Any]) -> None:
        """``model.json``."""
        path = os.path.join(progress_dir(self.run_dir), "model.json")
        self._hand(Pending(path, lambda: write_model_report(self.run_dir, report), self.step))

    def memory(self, report: dict[str, Any]) -> None:
        """This rank's memory accounting."""
        path = os.path.join(progress_dir(self.run_dir), f"memory-{self.rank:05d}.json")
        self._hand(Pending(path, lambda: write_memory(self.run_dir, self.rank, report), self.step))

    def checkpoint_missing(self, steps_done: int, exc: BaseException) -> None:
        """The checkpoint after ``steps_done`` steps could not be written: one line, the
        launcher told, the training goes on."""
        if steps_done in self.missing:
            return
        self.missing.append(steps_done)
        error = beacon.describe(exc)
        path = beacon.failed_path(exc, os.path.join(self.run_dir, "checkpoints"))
        logging.getLogger("megascope.rank").warning(
            "megascope: rank %d: the checkpoint at step %d is missing: cannot write %s (%s); "
            "training goes on",
            self.rank,
            steps_done,
            path,
            error,
        )
        self.sender.checkpoint_missing(self.rank, steps_done, f"{path}: {error}")


def _write_line(path: str, raw: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(raw + "\n")
    os.replace(tmp, path)


def read_ranks(run_dir: str) -> dict[int, RankLine]:
    """The latest line of every rank that has reported (unreadable files are skipped)."""
    out: dict[int, RankLine] = {}
    try:
        names = os.listdir(progress_dir(run_dir))
    except FileNotFoundError:
        return out
    for name in names:
        if not name.startswith("rank-") or not name[5:].isdigit():
            continue
        try:
            with open(os.path.join(progress_dir(run_dir), name), encoding="ascii") as f:
                raw = f.read().strip()
            pid, step, ns, state = raw.split()
            out[int(name[5:])] = RankLine(int(pid), int(step), int(ns), state, raw)
        except (OSError, ValueError):
            continue
    return out


def clear_ranks(run_dir: str, ranks: Any = None) -> None:
    """Forget the progress of an earlier launch (before a resume): of ``ranks`` only when
    given (a node's launcher clears its own ranks, never another node's)."""
    for rank in read_ranks(run_dir):
        if ranks is not None and rank not in ranks:
            continue
        try:
            os.remove(_rank_path(run_dir, rank))
        except FileNotFoundError:
            pass


def append_step(run_dir: str, record: dict[str, Any]) -> None:
    """Append one step's record to ``steps.jsonl`` (rank 0)."""
    append_steps(run_dir, [record])


def append_steps(run_dir: str, records: list[dict[str, Any]]) -> None:
    """Append steps' records to ``steps.jsonl`` (rank 0), in one write."""
    text = "".join(json.dumps(record) + "\n" for record in records)
    with open(os.path.join(progress_dir(run_dir), "steps.jsonl"), "a", encoding="utf-8") as f:
        f.write(text)


def read_steps(run_dir: str) -> list[dict[str, Any]]:
    """Rank 0's per-step records, one per step (the latest wins), in step order."""
    by_step: dict[int, dict[str, Any]] = {}
    try:
        with open(os.path.join(progress_dir(run_dir), "steps.jsonl"), encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    by_step[int(rec["step"])] = rec
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by a crash
    except FileNotFoundError:
        pass
    return [by_step[s] for s in sorted(by_step)]


def write_model_report(run_dir: str, report: dict[str, Any]) -> None:
    """Write ``model.json``."""
    write_json_atomic(os.path.join(progress_dir(run_dir), "model.json"), report)


def write_memory(run_dir: str, rank: int, report: dict[str, Any]) -> None:
    """Write rank ``rank``'s memory accounting."""
    write_json_atomic(os.path.join(progress_dir(run_dir), f"memory-{rank:05d}.json"), report)


def read_memory(run_dir: str) -> dict[str, dict[str, Any]]:
    """Every rank's memory accounting, ``{"0": {...}, ...}`` in rank order (unreadable files
    are skipped)."""
    out: dict[int, dict[str, Any]] = {}
    try:
        names = os.listdir(progress_dir(run_dir))
    except FileNotFoundError:
        return {}
    for name in names:
        stem = name[len("memory-") : -len(".json")]
        if not (name.startswith("memory-") and name.endswith(".json") and stem.isdigit()):
            continue
        try:
            with open(os.path.join(progress_dir(run_dir), name), encoding="utf-8") as f:
                out[int(stem)] = json.load(f)
        except (OSError, ValueError):
            continue
    return {str(r): out[r] for r in sorted(out)}


def read_model_report(run_dir: str, meta: dict[str, Any]) -> dict[str, Any]:
    """run.json keys updated with rank 0's model report (``{}`` when there is none)."""
    try:
        with open(os.path.join(progress_dir(run_dir), "model.json"), encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, ValueError):
        return {}
    model = dict(meta.get("model") or {})
    model["params"] = report.get("params")
    model["flops_per_token"] = report.get("flops_per_token")
    out: dict[str, Any] = {"model": model}
    if report.get("device_name"):
        out["device_name"] = report["device_name"]
    return out


# ---------------------------------------------------------------- summary and MFU

# Dense peak TFLOP/s per GPU (vendor data sheets; bf16 tensor cores, fp32 without TF32).
# Matched in order against torch.cuda.get_device_name(): the first substring found wins.
PEAK_TFLOPS: list[tuple[str, float, float]] = [  # (name part, bf16, fp32)
    ("H100 PCIe", 756.0, 51.0),
    ("H100", 989.4, 66.9),
    ("H200", 989.4, 66.9),
    ("GH200", 989.4, 66.9),
    ("B200", 2250.0, 80.0),
    ("A100", 312.0, 19.5),
    ("L40S", 362.0, 91.6),
    ("A10G", 70.0, 31.2),
    ("A10", 125.0, 31.2),
    ("L4", 121.0, 30.3),
]


def peak_flops(device_name: str | None, dtype: str) -> float | None:
    """Peak FLOP/s of one device by name, or None where it is not known (every CPU)."""
    if not device_name:
        return None
    for part, bf16, fp32 in PEAK_TFLOPS:
        if part in device_name:
            return (bf16 if dtype == "bf16" else fp32) * 1e12
    return None


def summarize(cfg: Any, steps: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """run.json's summary: steps done, median step time, throughput, MFU, first/last loss.

    The median leaves out the first step of each process (start-up work) when other steps
    exist. Tokens per step are the global batch: ``dp * microbatches * micro_batch_size *
    seq_len``. MFU = FLOPs per token x tokens/s / (world size x peak FLOP/s of one device).
    """
    summary: dict[str, Any] = {
        "steps": len(steps),
        "median_step_ms": None,
        "tokens_per_s": None,
        "mfu": None,
        "loss_first": steps[0]["loss"] if steps else None,
        "loss_last": steps[-1]["loss"] if steps else None,
    }
    if not steps:
        return summary
    timed = [s["step_ms"] for s in steps if not s.get("first")] or [s["step_ms"] for s in steps]
    median_ms = float(statistics.median(timed))
    tokens = cfg.parallel.dp * cfg.train.microbatches * cfg.train.micro_batch_size
    tokens *= cfg.model.seq_len
    summary["median_step_ms"] = round(median_ms, 3)
    if median_ms > 0:
        summary["tokens_per_s"] = round(tokens / (median_ms / 1e3), 1)
        peak = peak_flops(meta.get("device_name"), cfg.train.dtype)
        fpt = (meta.get("model") or {}).get("flops_per_token")
        if peak and fpt:
            summary["mfu"] = round(fpt * summary["tokens_per_s"] / (peak * cfg.world_size), 4)
    return summary


# ---------------------------------------------------------------- processes and stacks


def children(pid: int) -> set[int]:
    """Every descendant of ``pid`` (a scan of /proc; empty where there is no /proc)."""
    parent_of: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                parent_of[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {c for c, p in parent_of.items() if p in frontier and c not in found}
        found |= frontier
    return found


def has_own_stack(run_dir: str, rank: int) -> bool:
    """Whether rank ``rank`` (its tracer) has written a stacks part itself."""
    try:
        names = os.listdir(rank_dir(run_dir, "stacks", rank))
    except FileNotFoundError:
        return False
    return any(n.endswith(".parquet") and not n.startswith(("launcher-", ".")) for n in names)


def parse_pyspy(text: str) -> list[tuple[str, str]]:
    """``py-spy dump`` output as (thread header, stack text with the innermost frame first)."""
    threads: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("Thread "):
            threads.append((line.strip(), []))
        elif threads and line.startswith(" ") and line.strip():
            threads[-1][1].append(line.strip())
    return [(header, "\n".join(frames)) for header, frames in threads]


def pyspy() -> str | None:
    """The py-spy executable: beside this Python's, else on PATH (None if none)."""
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.path.exists(here) else shutil.which("py-spy")


def dump_to_run(run_dir: str, rank: int, pid: int, reason: str) -> bool:
    """Take ``py-spy dump`` of ``pid`` and write it as stacks rows of ``rank``.

    Written with the ``launcher`` prefix so it never collides with the rank's own parts.
    Returns whether a stack was written (py-spy missing or the process gone: False).
    """
    exe = pyspy()
    if exe is None:
        return False
    ts = time.time_ns()
    try:
        res = subprocess.run(
            [exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    threads = parse_pyspy(res.stdout) if res.returncode == 0 else []
    if not threads:
        return False
    write_part(
        run_dir,
        "stacks",
        rank,
        {
            "rank": [rank] * len(threads),
            "ts_ns": [ts] * len(threads),
            "reason": [reason] * len(threads),
            "thread": [t for t, _ in threads],
            "stack": [s for _, s in threads],
        },
        prefix="launcher",
    )
    return True
