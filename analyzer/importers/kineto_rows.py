"""Turn one reduced Kineto trace (:class:`RawTrace`) into SPEC rows.

Times: Kineto writes microseconds; with ``baseTimeNanoseconds`` they are relative to it,
otherwise absolute. Both become int64 nanoseconds. A trace with sub-microsecond times (float
``ts``) is rounded as Holistic Trace Analysis (HTA) rounds it by default: every event's start
up to the next whole microsecond, its end down (an event shorter than that keeps zero length,
where HTA leaves it a microsecond negative); ``exact_ns`` keeps the trace's nanoseconds.

Spans (``source`` cuda): every device event (:mod:`analyzer.importers.kineto_parse`). ``kind``
is ``comm`` for NCCL kernels (``ncclKernel_*`` and ``ncclDevKernel_*``), ``memory`` for
memcpy/memset/DMA (a kind this importer adds to the SPEC's four: HTA counts memory ops as
non-compute), ``host`` for CUDA synchronization records (the host waiting, drawn on a stream),
``compute`` otherwise. Each host ``ProfilerStep#N`` becomes a host span named ``step``.

A device span's ``step`` is the ``ProfilerStep#N`` in which its launch (the host event with
the same correlation id) began: the latest step that started at or before the launch, -1
before the first. Where the trace has several steps, HTA analyses only the device work
launched before the latest ``ProfilerStep`` annotation starts (on the host or, later, on the
GPU): work launched after that is the last step's, and its ``gpu_breakdown`` leaves it out;
work launched in the last host step but before that point keeps the step before (so that
the view equals HTA's); device events whose launch is not in the trace (launched before the
profiler started) are left out and counted, as HTA drops them. A trace with one step or none
keeps every device event, as HTA does; one without a launch takes the step of its own start.

Collectives: one row per NCCL kernel, with the arguments recent PyTorch records on it
(``Collective name``, ``In msg nelems``, ``dtype``, ``Group size``, ``Process Group Name`` /
``Description`` / ``Ranks``, ``Seq``); what a kernel lacks comes from the host annotation
(``nccl:all_to_all``) that encloses its launch, then from the kernel's name. A trace without
NCCL kernels (CPU, gloo) gives one row per ``gloo:*`` / ``nccl:*`` annotation instead, its
``issue_ns`` taken from the matching ``c10d::*`` call. ``seq`` is the recorded ``Seq`` or,
failing that, the collective's ordinal within its group on this rank (1, 2, ...).
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict, deque
from collections.abc import Mapping
from typing import Any

from analyzer.importers.common import dtype_bytes, empty_columns, normalize_op, numel
from analyzer.importers.groups import Group, parse_ranks
from analyzer.importers.kineto_parse import RawTrace

UNKNOWN_GROUP = "unknown"
_MEMORY_CATS = ("gpu_memcpy", "gpu_memset", "Memcpy", "Memset")


class Clock:
    """Kineto microseconds -> int64 nanoseconds on the trace's own clock.

    ``rounded``: HTA's default for a trace with sub-microsecond times (the module docstring).
    :meth:`us` is the time the window comparisons use (rounded like the spans).
    """

    def __init__(self, base_ns: Any, rounded: bool = False) -> None:
        self.base = int(base_ns) if isinstance(base_ns, (int, float)) else 0
        self.rounded = rounded

    def us(self, ts_us: Any) -> float:
        """The time the window comparisons use: ``ts_us`` rounded up on a rounded clock, else as
        is."""
        return math.ceil(ts_us) if self.rounded else ts_us

    def ns(self, ts_us: Any) -> int:
        """``ts_us`` as int64 nanoseconds on the trace's clock (rounded up to the microsecond on a
        rounded clock)."""
        if isinstance(ts_us, int):
            return self.base + ts_us * 1000
        if self.rounded:
            return self.base + math.ceil(ts_us) * 1000
        return self.base + int(round(float(ts_us) * 1000.0))

    def span(self, ts_us: Any, dur_us: Any) -> tuple[int, int]:
        """(start_ns, end_ns) of an event."""
        if self.rounded and not (isinstance(ts_us, int) and isinstance(dur_us, int)):
            start = math.ceil(ts_us)
            end = max(start, math.floor(ts_us + dur_us))
            return self.base + start * 1000, self.base + end * 1000
        start = self.ns(ts_us)
        return start, start + _dur_ns(dur_us)


def clock_of(raw: RawTrace, exact_ns: bool = False) -> Clock:
    """The clock of a trace: rounded as HTA rounds it unless ``exact_ns``."""
    return Clock(raw.meta.get("baseTimeNanoseconds"), rounded=raw.sub_us and not exact_ns)


def _dur_ns(dur_us: Any) -> int:
    return dur_us * 1000 if isinstance(dur_us, int) else int(round(float(dur_us) * 1000.0))


def device_kind(name: str, cat: str) -> str:
    """compute | comm | memory | host, as the module docstring defines them."""
    if "nccl" in name.lower():
        return "comm"
    if cat in _MEMORY_CATS or "Memcpy" in name or "Memset" in name or name.startswith("dma"):
        return "memory"
    if cat == "cuda_sync":
        return "host"
    return "compute"


class StepIndex:
    """``ProfilerStep#N`` intervals: which step a host time falls in (times as ``key`` maps
    them: a rounded clock's microseconds)."""

    def __init__(self, steps: list[tuple[int, float, float]], key: Any = None) -> None:
        self.key = key or (lambda t: t)
        self.steps = sorted(steps, key=lambda s: self.key(s[1]))
        self.starts = [self.key(s[1]) for s in self.steps]

    def at(self, ts_us: float) -> int:
        """The step whose interval started last at or before ``ts_us`` (-1: before the first)."""
        i = bisect.bisect_right(self.starts, self.key(ts_us)) - 1
        return self.steps[i][0] if i >= 0 else -1


class Enclosing:
    """Per host thread, the collective annotations: the one that encloses a launch."""

    def __init__(self, comm: list[tuple]) -> None:
        self.by_tid: dict[Any, list[tuple]] = defaultdict(list)
        for c in comm:
            self.by_tid[c[3]].append(c)
        self.starts: dict[Any, list[float]] = {}
        for tid, items in self.by_tid.items():
            items.sort(key=lambda c: c[1])
            self.starts[tid] = [c[1] for c in items]

    def find(self, ts_us: float, tid: Any) -> tuple | None:
        """The annotation on thread ``tid`` that encloses ``ts_us``, looked for among the last four
        to start by then; None if none does."""
        items = self.by_tid.get(tid)
        if not items:
            return None
        i = bisect.bisect_right(self.starts[tid], ts_us) - 1
        for j in range(i, max(i - 4, -1), -1):
            name, start, dur, _, _ = items[j]
            if start <= ts_us <= start + dur:
                return items[j]
        return None


class Window:
    """HTA's analysed window of one trace (the module docstring): with several profiler steps,
    the device work launched before ``end`` (the latest ProfilerStep annotation's start)."""

    def __init__(self, raw: RawTrace, clock: Clock) -> None:
        self.clock = clock
        self.index = StepIndex(raw.steps, clock.us)
        self.several = len({m[0] for m in raw.step_marks}) >= 2
        self.end = max((clock.us(m[1]) for m in raw.step_marks), default=None)
        order = [s[0] for s in self.index.steps]
        self.last = order[-1] if order else None
        self.before_last = order[-2] if len(order) >= 2 else -1

    def step(self, launch: tuple[float, Any] | None, ts_us: float) -> int:
        """The ``step`` of a device span launched at ``launch`` (None: not in the trace)."""
        if launch is None:
            return self.index.at(ts_us)
        step = self.index.at(launch[0])
        if (
            self.several
            and step == self.last
            and self.end is not None  # set whenever there are several steps
            and self.clock.us(launch[0]) < self.end
        ):
            return self.before_last
        return step


def drop_unlaunched(raw: RawTrace) -> int:
    """Leave out the device events whose launch is not in the trace, where HTA does (a trace
    of several profiler steps); returns how many (also kept in ``raw.no_launch``)."""
    if len({m[0] for m in raw.step_marks}) < 2:
        return 0
    kept = [d for d in raw.device if d[5] in raw.launches]
    raw.no_launch += len(raw.device) - len(kept)
    raw.device = kept
    return raw.no_launch


def span_rows(raw: RawTrace, rank: int, clock: Clock) -> dict[str, list[Any]]:
    """Device spans and host step spans of one rank (see the module docstring)."""
    cols = empty_columns("spans")
    window = Window(raw, clock)
    out = (cols["rank"], cols["step"], cols["microbatch"], cols["name"], cols["kind"],
           cols["start_ns"], cols["end_ns"], cols["source"])  # fmt: skip
    for name, cat, ts, dur, _stream, corr, _args in raw.device:
        start, end = clock.span(ts, dur)
        step = window.step(raw.launches.get(corr), ts)
        values = (rank, step, -1, name, device_kind(name, cat), start, end, "cuda")
        for col, v in zip(out, values, strict=True):
            col.append(v)
    for step, ts, dur in window.index.steps:
        start, end = clock.span(ts, dur)
        values = (rank, step, -1, "step", "host", start, end, "host")
        for col, v in zip(out, values, strict=True):
            col.append(v)
    return cols


def groups_of(raw: RawTrace) -> dict[str, Group]:
    """Process groups the trace knows: ``distributedInfo.pg_config`` and collective args."""
    out: dict[str, Group] = {}
    info = raw.meta.get("distributedInfo") or {}
    for pg in info.get("pg_config") or []:
        if isinstance(pg, dict) and pg.get("pg_name") is not None:
            name = str(pg["pg_name"])
            out[name] = Group(name, str(pg.get("pg_desc", "")), parse_ranks(pg.get("ranks")))
    arg_sets = [d[6] for d in raw.device if d[6]] + [p[2] for p in raw.params]
    for args in arg_sets:
        name = args.get("Process Group Name")
        if name is None or str(name) in out:
            continue
        ranks = parse_ranks(args.get("Process Group Ranks"))
        out[str(name)] = Group(str(name), str(args.get("Process Group Description", "")), ranks)
    return out


def _op_from_kernel(name: str) -> str | None:
    """``ncclDevKernel_AllReduce_Sum_f32_RING_LL`` -> ``all_reduce``."""
    for prefix in ("ncclDevKernel_", "ncclKernel_"):
        if name.startswith(prefix):
            token = name[len(prefix) :].split("_")[0].split("(")[0]
            return normalize_op(token)
    return None


def _nbytes(args: Mapping[str, Any], annotation: tuple | None) -> tuple[int, str]:
    """Bytes moved and dtype: ``In msg nelems`` x dtype, else the annotation's input."""
    dtype = str(args.get("dtype", ""))
    nelems = args.get("In msg nelems")
    if isinstance(nelems, int) and dtype:
        return nelems * dtype_bytes(dtype), dtype.lower()
    if annotation:
        a = annotation[4]
        dims, types = a.get("Input Dims") or [], a.get("Input type") or []
        if dims and types:
            return numel(dims[0]) * dtype_bytes(types[0]), str(types[0]).lower()
    return 0, dtype.lower()


def _append(cols: dict[str, list[Any]], row: Mapping[str, Any]) -> None:
    for k, v in row.items():
        cols[k].append(v)


def _kernel_rows(raw: RawTrace, rank: int, clock: Clock, labels: Mapping[str, str],
                 groups: Mapping[str, Group]) -> list[dict[str, Any]]:  # fmt: skip
    """One row per NCCL kernel, in launch order, ``seq`` still unset where not recorded."""
    enclosing = Enclosing(raw.comm)
    window = Window(raw, clock)
    rows = []
    for name, _cat, ts, dur, _stream, corr, args in raw.device:
        if "nccl" not in name.lower():
            continue
        args = args or {}
        launch = raw.launches.get(corr)
        ann = enclosing.find(*launch) if launch else None
        op = (normalize_op(str(args.get("Collective name", ""))) or
              (normalize_op(ann[0]) if ann else None) or _op_from_kernel(name) or "unknown")  # fmt: skip
        pg = args.get("Process Group Name")
        group = groups.get(str(pg)) if pg is not None else None
        label = labels.get(str(pg)) if pg is not None else None
        label = label or str(args.get("Process Group Description") or UNKNOWN_GROUP)
        size = args.get("Group size")
        nbytes, dtype = _nbytes(args, ann)
        start, end = clock.span(ts, dur)
        host_ts = ann[1] if ann else (launch[0] if launch else ts)
        seq = args.get("Seq")
        rows.append({
            "rank": rank, "step": window.step(launch, ts), "microbatch": -1,
            "op": op, "group": label,
            "group_size": size if isinstance(size, int) else len(group.ranks) if group else 0,
            "seq": int(seq) if isinstance(seq, (int, str)) and str(seq).isdigit() else None,
            "peer": -1, "nbytes": nbytes, "dtype": dtype, "issue_ns": min(clock.ns(host_ts), start),
            "start_ns": start, "end_ns": end, "source": "kineto",
        })  # fmt: skip
    return rows


def _annotation_rows(raw: RawTrace, rank: int, clock: Clock) -> list[dict[str, Any]]:
    """One row per ``gloo:*`` / ``nccl:*`` host annotation (traces without NCCL kernels)."""
    steps = StepIndex(raw.steps, clock.us)
    calls: dict[str, deque] = defaultdict(deque)
    for name, ts, _dur, _tid in sorted(raw.c10d, key=lambda c: c[1]):
        op = normalize_op(name)
        if op:
            calls[op].append(ts)
    info = raw.meta.get("distributedInfo") or {}
    pgs = info.get("pg_config") or []
    size = len(parse_ranks(pgs[0].get("ranks"))) if len(pgs) == 1 else 0
    rows = []
    for ann in sorted(raw.comm, key=lambda c: c[1]):
        name, ts, dur, _tid, _args = ann
        op = normalize_op(name)
        if op is None:
            continue
        queue = calls[op]
        issue = queue.popleft() if queue and queue[0] <= ts else ts
        nbytes, dtype = _nbytes({}, ann)
        start, end = clock.span(ts, dur)
        rows.append({
            "rank": rank, "step": steps.at(issue), "microbatch": -1, "op": op,
            "group": UNKNOWN_GROUP, "group_size": size, "seq": None, "peer": -1,
            "nbytes": nbytes, "dtype": dtype, "issue_ns": min(clock.ns(issue), start),
            "start_ns": start, "end_ns": end, "source": "kineto",
        })  # fmt: skip
    return rows


def collective_rows(raw: RawTrace, rank: int, clock: Clock, labels: Mapping[str, str],
                    groups: Mapping[str, Group]) -> dict[str, list[Any]]:  # fmt: skip
    """The collectives of one rank, in issue order (see the module docstring)."""
    has_nccl = any("nccl" in d[0].lower() for d in raw.device)
    if has_nccl:
        rows = _kernel_rows(raw, rank, clock, labels, groups)
    else:
        rows = _annotation_rows(raw, rank, clock)
    rows.sort(key=lambda r: (r["issue_ns"], r["start_ns"]))
    counters: dict[str, int] = defaultdict(int)
    cols = empty_columns("collectives")
    for row in rows:
        counters[row["group"]] += 1
        if row["seq"] is None:
            row["seq"] = counters[row["group"]]
        _append(cols, row)
    return cols


def heartbeat_rows(raw: RawTrace, rank: int, clock: Clock) -> dict[str, list[Any]]:
    """A heartbeat at the start of every profiler step (as the tracer beats per step)."""
    cols = empty_columns("heartbeats")
    for step, ts, _dur in sorted(raw.steps, key=lambda s: s[1]):
        _append(cols, {"rank": rank, "ts_ns": clock.ns(ts), "step": step, "state": "step"})
    return cols
