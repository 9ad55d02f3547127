"""The tracer's settings, with the environment variables that override them.

A frozen dataclass so that the settings can be recorded verbatim in ``run.json`` (``tracer``)
and passed to every part of the tracer without a global. ``TracerConfig.from_env()`` reads the
``MEGASCOPE_*`` variables that let a launcher tune a script it does not control.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

_ENV: dict[str, tuple[str, type]] = {
    "flush_every_steps": ("MEGASCOPE_FLUSH_STEPS", int),
    "flush_every_s": ("MEGASCOPE_FLUSH_SECONDS", float),
    "hang_timeout_s": ("MEGASCOPE_HANG_TIMEOUT", float),
    "nvml_hz": ("MEGASCOPE_NVML_HZ", float),
    "clock_every_steps": ("MEGASCOPE_CLOCK_STEPS", int),
    "exit_on_hang": ("MEGASCOPE_EXIT_ON_HANG", bool),
    "hang_exit_grace_s": ("MEGASCOPE_HANG_GRACE", float),
    "nccl_timing": ("MEGASCOPE_NCCL_TIMING", bool),
    "cpu_budget": ("MEGASCOPE_CPU_BUDGET", float),
    "attach_timeout_s": ("MEGASCOPE_ATTACH_TIMEOUT", float),
    "ddp_comm_hook": ("MEGASCOPE_DDP_HOOK", bool),
    "funcol_waits": ("MEGASCOPE_FUNCOL", bool),
}


def _parse(kind: type, text: str) -> Any:
    if kind is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(text)
    return kind(text)


@dataclass(frozen=True)
class TracerConfig:
    """What the tracer records and how often it writes.

    ``flush_every_steps`` / ``flush_every_s``: a flush happens at whichever comes first.
    ``max_rows``: per table, rows held in memory between flushes; more are dropped and counted.
    ``compact_parts``: merge a table's parts into one file once there are this many (and at
    close), so that Parquet footers do not dominate the bytes per row.
    ``hang_timeout_s``: no step and no completed collective for this long is a hang (0: off).
    ``clock_rounds``: round trips per offset estimate (the tightest one is kept);
    ``clock_every_steps``: re-estimate the offsets every so many steps (0: only at attach);
    ``clock_same_host``: measure ranks on rank 0's host too (their offset is 0 by construction).
    ``nvml_hz``: GPU telemetry sampling rate (0: off). ``stacks_file``: a file in the run
    directory whose modification asks every rank for a stack dump.
    ``exit_on_hang``: after a hang is on disk (stacks, the collectives in flight), end this
    process with status 3 (``hang_exit_grace_s`` later, so that the other ranks record theirs
    too). Off by default: megascope's launcher ends a hung run itself; ``tracer.run`` turns it
    on, since under a plain torchrun nothing else would end the job before its collective
    timeout.
    ``nccl_timing``: have NCCL time every collective on the device (CUDA events), so that what
    Flight Recorder reads of DDP, FSDP and DTensor carries its device duration; attach turns
    it on for the groups already made and sets ``TORCH_NCCL_ENABLE_TIMING`` for later ones.
    ``cpu_budget``: the share of the rank's CPU time the tracer may take; over it, the flush
    interval widens (tracer.budget; 0: never widen).
    ``attach_timeout_s``: how long attach waits for the other ranks to form the tracer's clock
    group; a rank whose attach failed (or never ran) holds the others this long, not for the
    process groups' timeout (30 minutes on gloo), and they trace on without it.
    ``ddp_comm_hook``: on a CPU rank, time DDP's gradient all-reduces through a comm hook
    (tracer/ddpcomm.py); off, they are Flight Recorder's untimed rows, and a straggler under
    DDP is told from its late arrival at them (analyzer/findings/late_arrival.py).
    ``funcol_waits``: time the functional collectives (DTensor, tensor parallelism) in eager
    mode on CPU tensors, their issue and the rank's wait (tracer/funcol.py); off, they are
    Flight Recorder's untimed rows, whose waits the analyzer infers from the arrivals.
    """

    flush_every_steps: int = 10
    flush_every_s: float = 5.0
    max_rows: int = 1_000_000
    compact_parts: int = 8
    hang_timeout_s: float = 300.0
    clock_rounds: int = 8
    clock_every_steps: int = 200
    clock_sync: bool = True
    clock_same_host: bool = False
    nvml_hz: float = 10.0
    cuda_events: bool = True
    event_pool: int = 4096
    capture_collectives: bool = True
    stacks_on_signal: bool = True
    stacks_file: str = "dump-stacks"
    exit_on_hang: bool = False
    hang_exit_grace_s: float = 5.0
    nccl_timing: bool = True
    cpu_budget: float = 0.01
    attach_timeout_s: float = 300.0
    ddp_comm_hook: bool = True
    funcol_waits: bool = True

    @classmethod
    def from_env(cls, base: TracerConfig | None = None) -> TracerConfig:
        """``base`` (or the defaults) with the ``MEGASCOPE_*`` overrides that are set."""
        cfg = base or cls()
        changes: dict[str, Any] = {}
        for field, (var, kind) in _ENV.items():
            text = os.environ.get(var)
            if text is None or not text.strip():
                continue
            try:
                changes[field] = _parse(kind, text)
            except ValueError:
                raise ValueError(f"{var}={text!r} is not a valid {kind.__name__}") from None
        return dataclasses.replace(cfg, **changes) if changes else cfg

    def as_dict(self) -> dict[str, Any]:
        """Every setting by name (run.json's ``tracer``)."""
        return dataclasses.asdict(self)
