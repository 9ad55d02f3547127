"""The tracer's hardware class of a rank (tracer/hwclass.py, topology's ``hw_class``).

The live test attaches the tracer in a gloo world of one rank, with ``MEGASCOPE_HW_CLASS`` set
and unset, and reads the class back from the run's topology table. On a CPU rank the class is
made from the host's CPU model and the NVML columns are null; the NVML readings of a GPU rank
need a GPU (none here: its label from the device's name is checked without NVML).
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from helpers.tables import QUIET, read

import tracer
from analyzer.db import open_run
from tracer import hwclass


def test_a_label_from_a_name():
    assert hwclass.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert hwclass.slug("  Intel(R) Xeon(R) Platinum 8480+ ") == "intel-r-xeon-r-platinum-8480"


def test_a_cpu_rank_is_its_cpu_model_unless_labelled(monkeypatch):
    monkeypatch.delenv(hwclass.ENV, raising=False)
    hw = hwclass.describe("cpu")
    model = hwclass.cpu_model()
    assert model and hw.cpu_model == model and hw.hw_class == hwclass.slug(model)
    assert (hw.device_name, hw.max_sm_clock_mhz, hw.power_limit_w) == (None, None, None)
    monkeypatch.setenv(hwclass.ENV, "rack7-h100")
    assert hwclass.describe("cpu").hw_class == "rack7-h100"


def test_a_gpu_rank_is_its_device_name(monkeypatch):
    monkeypatch.delenv(hwclass.ENV, raising=False)
    hw = hwclass.describe("cuda", device_name="NVIDIA H200", device_mem_bytes=150 << 30)
    assert hw.hw_class == "nvidia-h200" and hw.device_mem_bytes == 150 << 30


def _attach_one(rank: int, world: int, run: str, label: str | None) -> str:
    """One rank, two steps, the tracer attached with ``label`` as MEGASCOPE_HW_CLASS."""
    if label is None:
        os.environ.pop(hwclass.ENV, None)
    else:
        os.environ[hwclass.ENV] = label
    tracer.attach(run, mesh={"dp": 1, "pp": 1, "tp": 1, "cp": 1}, config=QUIET)
    for step in range(2):
        tracer.step(step)
        with tracer.span("forward", microbatch=0):
            dist.barrier()
    tracer.close()
    return hwclass.describe("cpu").hw_class or ""


@pytest.mark.parametrize("label", ["h100-rack7", None])
def test_the_tracer_writes_the_class_into_topology(ranks, tmp_path, label):
    run = str(tmp_path / "run")
    [derived] = ranks(_attach_one, 1, run, label)
    rows = read(run, "topology")
    assert rows and {r["hw_class"] for r in rows} == {label or derived}
    assert {r["cpu_model"] for r in rows} == {hwclass.cpu_model()}
    assert {r["device_name"] for r in rows} == {None}  # a CPU rank: no device, no NVML
    assert {r["power_limit_w"] for r in rows} == {None}
    r = open_run(run)
    try:
        got = r.query("findings/hw_classes")
    finally:
        r.close()
    assert got.to_dict("records") == [{"rank": 0, "hw_class": label or derived}]
