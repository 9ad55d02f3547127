"""Stream one Kineto (PyTorch profiler) trace into the few compact lists the import needs.

The trace is a JSON object ``{"distributedInfo": ..., "baseTimeNanoseconds": ...,
"traceEvents": [...]}``, often gzip-compressed and many GB large. It is never loaded whole:
a header scan reads the top-level keys that precede ``traceEvents`` (where Kineto writes
them), then ``ijson`` (C backend) yields the events one by one, and each is reduced at once to
a tuple in one of these lists:

* ``device``: GPU kernels, memcpys and memsets (``cat`` kernel / gpu_memcpy / gpu_memset);
* ``launches``: ``correlation -> (ts, tid)`` of the CUDA runtime calls that launched them;
* ``steps``: ``ProfilerStep#N`` annotations;
* ``comm``: host-side collective annotations (``nccl:*``, ``gloo:*``) per thread, and
  ``record_param_comms`` ops with their arguments;
* ``c10d``: the ``c10d::*`` ops (the host call of a collective).

Times stay in the trace's microseconds here; :mod:`analyzer.importers.kineto_rows` converts.
Top-level keys written after the events (some writers do) are read from the last bytes of
the stream, which :class:`TailReader` keeps while the events pass through: the document's
tail after the ``]`` that closes ``traceEvents`` is itself a small JSON object's body.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

import ijson

from analyzer.importers.common import TraceError

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"}
RUNTIME_CATS = {"cuda_runtime", "cuda_driver", "Runtime", "Driver"}
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
    # (step, ts_us, dur_us)
    steps: list[tuple[int, float, float]] = field(default_factory=list)
    # (name, ts_us, dur_us, tid, args)
    comm: list[tuple] = field(default_factory=list)
    # (ts_us, tid, args) of record_param_comms
    params: list[tuple] = field(default_factory=list)
    # (name, ts_us, dur_us, tid)
    c10d: list[tuple] = field(default_factory=list)
    pid: int = -1
    events: int = 0


class TailReader:
    """A binary file wrapper that remembers the last ``keep`` bytes read through it."""

    def __init__(self, f: IO[bytes], keep: int = 1 << 20) -> None:
        self.f, self.keep, self.tail = f, keep, bytearray()

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.tail += data
        if len(self.tail) > 2 * self.keep:
            del self.tail[: len(self.tail) - self.keep]
        return data


def trailing_keys(tail: bytes, attempts: int = 64) -> dict[str, Any]:
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


def _opener(path: str) -> Callable[[], IO[bytes]]:
    if path.endswith(".gz"):
        return lambda: gzip.open(path, "rb")
    return lambda: open(path, "rb")


def _scan_meta(f: IO[bytes]) -> tuple[dict[str, Any], bool]:
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


def _add_event(raw: RawTrace, ev: dict[str, Any]) -> None:
    """Reduce one event into the lists of :class:`RawTrace` (most events are dropped)."""
    if ev.get("ph") != "X":
        return
    cat = ev.get("cat", "")
    name = ev.get("name", "")
    if cat in DEVICE_CATS:
        args = ev.get("args") or {}
        nccl = "nccl" in name.lower()
        stream = args.get("stream", ev.get("tid", -1))
        raw.device.append(
            (name, cat, ev["ts"], ev.get("dur", 0), stream, args.get("correlation", -1),
             args if nccl else None)
        )  # fmt: skip
    elif cat in RUNTIME_CATS:
        corr = (ev.get("args") or {}).get("correlation")
        if corr is not None:
            raw.launches[corr] = (ev["ts"], ev.get("tid"))
    elif name.startswith("ProfilerStep#"):
        try:
            raw.steps.append((int(name[13:]), ev["ts"], ev.get("dur", 0)))
        except ValueError:
            return
    elif name.startswith(_COMM_PREFIXES):
        raw.comm.append((name, ev["ts"], ev.get("dur", 0), ev.get("tid"), ev.get("args") or {}))
    elif name == "record_param_comms":
        raw.params.append((ev["ts"], ev.get("tid"), ev.get("args") or {}))
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
                if isinstance(ev, dict) and "ts" in ev:
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
