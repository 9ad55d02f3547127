"""A rank's hardware class: what it runs on (device, memory, host CPU, clocks, power limit) and
the label that the analyzer compares peers within (docs/spec.md §2, ``topology``).

Clusters mix hardware (GPU models, host CPUs, power caps): a rank on a slower class is not a
straggler among its own class. Each rank writes its class into its topology row at attach:
``hw_class`` is ``MEGASCOPE_HW_CLASS`` when set, else a label made from the device's name (a
GPU) or the host's CPU model (a CPU rank), lower case with runs of other characters as one
``-`` (``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``). The clocks and the power limit
come from NVML where a GPU and NVML are present, and are null otherwise (UNVERIFIED on the
project's machines, which have no GPU).
"""

from __future__ import annotations

import os
import platform
import re
from dataclasses import astuple, dataclass
from typing import Any

ENV = "MEGASCOPE_HW_CLASS"


@dataclass(frozen=True)
class HwClass:
    """The topology columns of a rank's hardware, in the table's order (all nullable)."""

    device_name: str | None = None
    device_mem_bytes: int | None = None
    cpu_model: str | None = None
    max_sm_clock_mhz: int | None = None
    max_mem_clock_mhz: int | None = None
    power_limit_w: float | None = None
    hw_class: str | None = None

    def row(self) -> tuple[Any, ...]:
        """The columns as a tuple, in the table's order."""
        return astuple(self)


def slug(text: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``: a label made from a name."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def cpu_model() -> str | None:
    """The host CPU's model name (``/proc/cpuinfo``, else what the platform reports)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() in ("model name", "Model", "cpu model"):
                    return value.strip() or None
    except OSError:
        pass
    return platform.processor() or platform.machine() or None


def _nvml(handle: Any) -> dict[str, Any]:
    """Name, memory, maximum clocks and enforced power limit of an NVML device; a field NVML
    does not give is left out."""
    import pynvml as n

    out: dict[str, Any] = {}
    calls = {
        "device_name": lambda: n.nvmlDeviceGetName(handle),
        "device_mem_bytes": lambda: int(n.nvmlDeviceGetMemoryInfo(handle).total),
        "max_sm_clock_mhz": lambda: int(n.nvmlDeviceGetMaxClockInfo(handle, n.NVML_CLOCK_SM)),
        "max_mem_clock_mhz": lambda: int(n.nvmlDeviceGetMaxClockInfo(handle, n.NVML_CLOCK_MEM)),
        "power_limit_w": lambda: n.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0,
    }
    for key, call in calls.items():
        try:
            value = call()
        except Exception:
            continue
        out[key] = value.decode() if isinstance(value, bytes) else value
    return out


def describe(
    device: str,
    *,
    handle: Any = None,
    device_name: str | None = None,
    device_mem_bytes: int | None = None,
) -> HwClass:
    """This rank's hardware class. ``device``: ``cpu`` or ``cuda``; ``handle``: its NVML
    device where there is one (its readings win); ``device_name``/``device_mem_bytes``: what
    torch says of the GPU, where NVML does not."""
    fields: dict[str, Any] = {"device_name": device_name, "device_mem_bytes": device_mem_bytes}
    if handle is not None:
        fields.update(_nvml(handle))
    cpu = cpu_model()
    label = os.environ.get(ENV, "").strip()
    if not label:
        named = fields["device_name"] if device == "cuda" else cpu
        label = slug(named) if named else ""
    return HwClass(cpu_model=cpu, hw_class=label or None, **fields)
