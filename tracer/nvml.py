"""GPU telemetry: an NVML sampler thread writing the ``gpu`` table (docs/spec.md §2).

One sampler per rank samples the rank's own GPU (its local rank's device) at ``hz`` (10 by
default): SM and memory clocks, power, temperature, utilization, memory used, the clock-event
(throttle) reasons bitmask, PCIe throughput and the volatile uncorrected ECC count. Each field
is read on its own, so a field a GPU does not support is null instead of losing the sample.
``pcie_tx_bps``/``pcie_rx_bps`` are bytes per second (NVML reports KiB/s over a 20 ms window).

Without NVML (no driver, no GPU, or the library missing) it says so once at info level and
stays off. UNVERIFIED on the project's machines, which have no GPU.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from tracer.clock import now_ns

log = logging.getLogger(__name__)


def open_device(cuda_index: int) -> Any | None:
    """An NVML handle for CUDA device ``cuda_index``, or None (logged once) without NVML.

    NVML numbers every GPU of the machine while CUDA numbers the visible ones
    (``CUDA_VISIBLE_DEVICES``), so the device is found by its UUID when torch knows it.
    """
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:
        log.info("megascope: no NVML (%s); GPU telemetry is off", exc.__class__.__name__)
        return None
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(cuda_index).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:
        pass
    try:
        return pynvml.nvmlDeviceGetHandleByIndex(cuda_index)
    except Exception as exc:
        log.info("megascope: NVML has no device %d (%s); GPU telemetry is off", cuda_index, exc)
        return None


def gpu_uuid(handle: Any) -> str | None:
    """The device's uuid from NVML (None when NVML cannot say)."""
    try:
        import pynvml

        uuid = pynvml.nvmlDeviceGetUUID(handle)
        return uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    except Exception:
        return None


def _field(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:
        return None


def sample(handle: Any) -> tuple[Any, ...]:
    """One ``gpu`` row (without rank) for the device."""
    import pynvml as n

    clocks = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
        n, "nvmlDeviceGetCurrentClocksThrottleReasons", None
    )
    power = _field(lambda: n.nvmlDeviceGetPowerUsage(handle))
    util = _field(lambda: n.nvmlDeviceGetUtilizationRates(handle).gpu)
    mem = _field(lambda: n.nvmlDeviceGetMemoryInfo(handle).used)
    tx = _field(lambda: n.nvmlDeviceGetPcieThroughput(handle, n.NVML_PCIE_UTIL_TX_BYTES))
    rx = _field(lambda: n.nvmlDeviceGetPcieThroughput(handle, n.NVML_PCIE_UTIL_RX_BYTES))
    ecc = _field(
        lambda: n.nvmlDeviceGetTotalEccErrors(
            handle, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC
        )
    )
    return (
        now_ns(),
        _field(lambda: n.nvmlDeviceGetClockInfo(handle, n.NVML_CLOCK_SM)),
        _field(lambda: n.nvmlDeviceGetClockInfo(handle, n.NVML_CLOCK_MEM)),
        power / 1000.0 if power is not None else None,
        _field(lambda: float(n.nvmlDeviceGetTemperature(handle, n.NVML_TEMPERATURE_GPU))),
        float(util) if util is not None else None,
        int(mem) if mem is not None else None,
        _field(lambda: int(clocks(handle))) if clocks else None,
        tx * 1024.0 if tx is not None else None,
        rx * 1024.0 if rx is not None else None,
        int(ecc) if ecc is not None else None,
    )


class Sampler:
    """A daemon thread adding one ``gpu`` row every ``1/hz`` seconds until stopped."""

    def __init__(
        self,
        handle: Any,
        hz: float,
        add: Callable[[tuple[Any, ...]], None],
        cost: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
    ) -> None:
        self._handle = handle
        self._cost = cost or contextlib.nullcontext
        self._period = 1.0 / hz
        self._add = add
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megascope-nvml", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                with self._cost():
                    self._add(sample(self._handle))
            except Exception as exc:
                log.warning("megascope: NVML sampling stopped: %s", exc)
                return

    def stop(self) -> None:
        """Ask the thread to stop; it takes no sample after its current wait."""
        self._stop.set()
