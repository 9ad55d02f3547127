"""Stream one Kineto (PyTorch profiler) trace into the few compact lists the import needs.

The trace is a JSON object ``{"distributedInfo": ..., "baseTimeNanoseconds": ...,
"traceEvents": [...]}``, often gzip-compressed and many GB large. It is never loaded whole:
a header scan reads the top-level keys that precede ``traceEvents`` (where Kineto writes
them), then ``ijson`` (C backend) yields the events one by one, and each is reduced at once to
a tuple in one of these lists:

* ``device``: the work of a device, whatever its kind (CUDA, ROCm/HIP, MTIA): every complete
  event (with ``cat`` and ``dur``) whose ``args.stream`` is a stream number (kernels, memcpys,
  memsets, MTIA ``mtia_ccp_events``, CUDA synchronization records), as Holistic Trace Analysis
  (HTA) tells device events from host ones; a ``kernel`` / ``gpu_memcpy`` / ``gpu_memset``
  event without a stream argument counts too, on its ``tid``;
* ``launches``: ``correlation -> (ts, tid)`` of the host events that carry a correlation id
  (``cudaLaunchKernel``, ``hipLaunchKernel``, MTIA's runtime...): the launch of the device
  event with the same id (the earliest such event when several do);
* ``steps``: host ``ProfilerStep#N`` annotations; ``step_marks``: the starts of every
  ``ProfilerStep#N`` annotation, the GPU-side copies (``gpu_user_annotation``) included, since
  HTA's window ends at the latest of them;
* ``comm``: host-side collective annotations (``nccl:*``, ``gloo:*``) per thread, and
  ``record_param_comms`` ops with their arguments;
* ``c10d``: the ``c10d::*`` ops (the host call of a collective).

Times stay in the trace's microseconds here; :mod:`analyzer.importers.kineto_rows` converts.
``float_ts`` tells whether the trace has sub-microsecond times (some ``ts`` is a float, or
missing): HTA rounds such a trace's times to whole microseconds by default.
Top-level keys written after the events (some writers do) are read from the last bytes of
the stream, which :class:`TailReader` keeps while the events pass through: the document's
tail after the ``]`` that closes ``traceEvents`` is itself a small JSON object's body.
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ijson

from analyzer.importers.common import TraceError

# Device events by category, for events that lack a stream argument (Kineto always writes one).
DEVICE_CATS = {
    "kernel",
    "gpu_memcpy",
    "gpu_memset",
    "Kernel",
    "Memcpy",
    "Memset",
    "mtia_ccp_events",
}
META_KEYS = ("distributedInfo", "baseTimeNanoseconds", "host_name", "deviceProperties")
_COMM_PREFIXES = ("nccl:", "gloo:", "ucc:", "mpi:")


@dataclass
class RawTrace:
    """One rank's trace, reduced. Tuples are documented on the fields."""

    path: str
    meta: dict[str, Any] = field(default_factory=dict)
    # (name, cat, ts_us, dur_us, stream, correlation, args or None for non-NCCL kernels)
    device: list[tuple] = field(default_factory=list)
    # correlation -> (ts_us, tid)
    launches: dict[int, tuple[float, Any]] = field(default_factory=dict)
    # (step, ts_us, dur_us) of the host ProfilerStep annotations
    steps: list[tuple[int, float, float]] = field(default_factory=list)
    # (step, ts_us) of every ProfilerStep annotation, host and GPU side
    step_marks: list[tuple[int, float]] = field(default_factory=list)
    # (name, ts_us, dur_us, tid, args)
    comm: list[tuple] = field(default_factory=list)
    # (ts_us, tid, args) of record_param_comms
    params: list[tuple] = field(default_factory=list)
    # (name, ts_us, dur_us, tid)
    c10d: list[tuple] = field(default_factory=list)
    pid: int = -1
    events: int = 0
    float_ts: bool = False  # some event's ts is a float or missing
    other_ts: bool = False  # some event's ts is not a number at all
    no_launch: int = 0  # device events left out: no launch record (set by the importer)

    @property
    def sub_us(self) -> bool:
        """Whether HTA would round this trace's times to microseconds (its default)."""
        return self.float_ts and not self.other_ts


class TailReader:
    """A binary file wrapper that remembers the last ``keep`` bytes read through it."""

    def __init__(self, f: io.BufferedIOBase, keep: int = 1 << 20) -> None:
        self.f, self.keep, self.tail = f, keep, bytearray()

    def read(self, n: int = -1) -> bytes:
        """Read up to ``n`` bytes (all with -1), keeping them in the tail."""
        data = self.f.read(n)
        self.tail += data
        if len(self.tail) > 2 * self.keep:
            del self.tail[: len(self.tail) - self.keep]
        return data


def trailing_keys(tail: bytes | bytearray, attempts: int = 64) -> dict[str, Any]:
    """The top-level keys that follow the ``traceEvents`` array, from the document's tail.

    Tries each ``]`` from the end: the right one is followed by ``, "key": value ... }``,
    which parses as an object once its comma becomes ``{``; a ``]`` inside a trailing value
    leaves unbalanced braces and fails to parse.
    """
    text = bytes(tail).rstrip()
    pos = len(text)
    for _ in range(attempts):
        pos = text.rfind(b"]", 0, pos)
        if pos < 0:
            return {}
        rest = text[pos + 1 :].lstrip()
        if not rest.startswith(b","):
            if rest == b"}":
                return {}
            continue
        try:
            obj = json.loads(b"{" + rest[1:])
        except ValueError:
            continue
        return obj if isinstance(obj, dict) else {}
    return {}


def _opener(path: str) -> Callable[[], io.BufferedIOBase]:
    if path.endswith(".gz"):
        return lambda: gzip.open(path, "rb")
    return lambda: open(path, "rb")


def _scan_meta(f: io.BufferedIOBase) -> tuple[dict[str, Any], bool]:
    """The top-level keys before ``traceEvents``, and whether ``traceEvents`` was found.

    Reads token by token (slow per byte), but only the header: it stops at ``traceEvents``.
    """
    meta: dict[str, Any] = {}
    key: str | None = None
    builder: ijson.ObjectBuilder | None = None
    for prefix, event, value in ijson.parse(f, use_float=True):
        if prefix == "" and event in ("map_key", "end_map"):
            if builder is not None and key is not None:
                meta[key] = builder.value
            builder, key = None, value
            if value == "traceEvents":
                return meta, True
            if event == "map_key":
                builder = ijson.ObjectBuilder()
        elif builder is not None:
            builder.event(event, value)
    return meta, False


def stream_of(args: dict[str, Any]) -> int:
    """``args.stream`` as a stream number, -1 when absent or not a number (as HTA reads it)."""
    value = args.get("stream")
    if isinstance(value, bool) or value is None:
        return -1
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return -1


def _note_ts(raw: RawTrace, ev: dict[str, Any]) -> None:
    ts = ev.get("ts")
    if isinstance(ts, float) or ts is None:
        raw.float_ts = True
    elif isinstance(ts, bool) or not isinstance(ts, int):
        raw.other_ts = True


def _add_event(raw: RawTrace, ev: dict[str, Any]) -> None:
    """Reduce one event into the lists of :class:`RawTrace` (most events are dropped)."""
    if ev.get("ph") != "X":
        return
    cat = ev.get("cat")
    name = ev.get("name", "")
    if not isinstance(name, str):
        name = str(name)
    args = ev.get("args")
    args = args if isinstance(args, dict) else {}
    timed = isinstance(cat, str) and cat != "Trace" and isinstance(ev.get("dur"), (int, float))
    stream = stream_of(args) if timed else -1
    if stream >= 0 or (timed and cat in DEVICE_CATS and "stream" not in args):
        nccl = "nccl" in name.lower()
        if stream < 0:
            stream = ev.get("tid", -1)
        corr = args.get("correlation", -1)
        raw.device.append(
            (name, cat, ev["ts"], ev["dur"], stream, corr if isinstance(corr, int) else -1,
             args if nccl else None)
        )  # fmt: skip
        return
    corr = args.get("correlation")
    if timed and isinstance(corr, int) and not isinstance(corr, bool):
        seen = raw.launches.get(corr)
        if seen is None or ev["ts"] < seen[0]:
            raw.launches[corr] = (ev["ts"], ev.get("tid"))
    if name.startswith("ProfilerStep#"):
        try:
            step = int(name[13:])
        except ValueError:
            return
        raw.step_marks.append((step, ev["ts"]))
        if cat != "gpu_user_annotation":
            raw.steps.append((step, ev["ts"], ev.get("dur", 0)))
    elif name.startswith(_COMM_PREFIXES) and cat != "gpu_user_annotation":  # host side only
        raw.comm.append((name, ev["ts"], ev.get("dur", 0), ev.get("tid"), args))
    elif name == "record_param_comms":
        raw.params.append((ev["ts"], ev.get("tid"), args))
    elif name.startswith("c10d::"):
        raw.c10d.append((name, ev["ts"], ev.get("dur", 0), ev.get("tid")))
    if cat == "cpu_op" and raw.pid == -1 and isinstance(ev.get("pid"), int):
        raw.pid = ev["pid"]


def parse_trace(path: str) -> RawTrace:
    """Stream one trace file into a :class:`RawTrace`; :class:`TraceError` names the file
    when it is truncated, not JSON, or not a Kineto trace."""
    open_ = _opener(path)
    raw = RawTrace(path=path)
    try:
        with open_() as f:
            raw.meta, seen = _scan_meta(f)
        if not seen:
            raise TraceError(f"{path}: not a Kineto trace (no traceEvents)")
        with open_() as f:
            reader = TailReader(f)
            for ev in ijson.items(reader, "traceEvents.item", use_float=True):
                raw.events += 1
                if isinstance(ev, dict):
                    _note_ts(raw, ev)
                    if isinstance(ev.get("ts"), (int, float)) and not isinstance(ev["ts"], bool):
                        _add_event(raw, ev)
        late = trailing_keys(reader.tail)
        raw.meta = {**{k: v for k, v in late.items() if k != "traceEvents"}, **raw.meta}
    except TraceError:
        raise
    except (ijson.JSONError, EOFError, zlib.error, gzip.BadGzipFile, UnicodeDecodeError) as e:
        raise TraceError(
            f"{path}: truncated or malformed trace ({type(e).__name__}: {e})"
        ) from None
    except (OSError, TypeError, KeyError, ValueError) as e:
        raise TraceError(f"{path}: unreadable trace ({type(e).__name__}: {e})") from None
    return raw
