"""The GPU paths, where a GPU is present (skipped elsewhere): CUDA-event spans, NCCL
collectives timed on the device, Flight Recorder entries the wrappers did not see, NVML rows.

    .venv/bin/python -m pytest -q tests/test_gpu.py     # on a machine with a GPU
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers.net import free_port
from helpers.paths import SCRIPTS
from helpers.tables import read

from tracer import rundir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not torch.distributed.is_nccl_available(),
    reason="needs a CUDA GPU and NCCL",
)


@pytest.fixture(scope="module")
def run(tmp_path_factory, launch) -> str:
    out = str(tmp_path_factory.mktemp("gpu") / "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
           f"--master-port={free_port()}", os.path.join(SCRIPTS, "gpu_script.py"), out]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": ROOT, "MEGASCOPE_NVML_HZ": "50"}
    p = launch(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = p.communicate(timeout=300)
    assert p.returncode == 0, output
    return out


def test_spans_are_timed_by_cuda_events(run):
    spans = read(run, "spans", "name = 'forward' and step >= 0")
    assert len(spans) == 6
    assert {s["source"] for s in spans} == {"cuda"}
    assert all(s["end_ns"] > s["start_ns"] for s in spans)


def test_nccl_collectives_are_timed_on_the_device(run):
    rows = read(run, "collectives", "op = 'all_reduce' and nbytes = 4194304")
    assert len(rows) == 6
    assert {r["source"] for r in rows} == {"cuda"}
    assert all(r["issue_ns"] <= r["start_ns"] < r["end_ns"] for r in rows)


def test_flight_recorder_sees_what_the_wrappers_did_not(run):
    rows = read(run, "collectives", "op = 'all_reduce' and nbytes = 1048576")
    assert len(rows) == 6, rows
    assert {r["source"] for r in rows} == {"flight_recorder"}
    assert all(r["end_ns"] is not None and r["end_ns"] >= r["start_ns"] for r in rows)
    # one numbering for both: the wrappers' (the group's counter) and Flight Recorder's never
    # give two calls one number
    seqs = [r["seq"] for r in read(run, "collectives", "op = 'all_reduce'")]
    assert len(seqs) == len(set(seqs)) == 12, sorted(seqs)
    # attach turned NCCL's device timing on for the group made before it: the rows that
    # Flight Recorder gave carry the device's duration
    summary = rundir.read_run_json(run)["summary"]["flight_recorder"]
    assert summary["timed"] == 6, summary
    assert "nccl" in summary["rings"], summary


def test_a_ddp_script_on_a_gpu_has_its_gradient_all_reduces(tmp_path, attach):
    """The DDP example under torchrun and tracer.run: DDP's reducer issues its all_reduces in
    C++, where only NCCL's Flight Recorder sees them."""
    out = str(tmp_path / "ddp")
    p = attach(out, "ddp.py", nproc=1, steps=8, size=(), timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = read(out, "collectives", "op = 'all_reduce' and step >= 0")
    assert rows, "no all_reduce rows"
    assert {r["source"] for r in rows} == {"flight_recorder"}
    assert len({r["step"] for r in rows}) >= 6
    assert all(r["start_ns"] <= r["end_ns"] for r in rows)


def test_nvml_rows(run):
    gpu = read(run, "gpu")
    assert len(gpu) > 0
    assert all(g["sm_clock_mhz"] > 0 and g["power_w"] > 0 for g in gpu)


def test_a_step_queues_without_host_syncs():
    """An engine step on one GPU (compiled blocks, the default there) makes no host sync until
    its loss is read: the host queues the next step while the device works."""
    from trainer.config import ModelConfig, ParallelConfig, TrainConfig
    from trainer.engine import Engine
    from trainer.parallel.mesh import Mesh

    train = TrainConfig(steps=10, microbatches=2, micro_batch_size=2, device="cuda",
                        dtype="bf16")  # fmt: skip
    assert train.compiles
    model = ModelConfig(n_layer=2, d_model=128, n_head=4, seq_len=64)
    engine = Engine(model, train, Mesh(ParallelConfig()))
    batch = torch.randint(0, model.vocab_size, (2, 2, model.seq_len + 1))
    float(engine.train_step_async(batch))  # compile and warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = engine.train_step_async(batch)  # on the host, as the trainer's loader gives it
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(loss).item()
