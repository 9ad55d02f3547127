"""Optimizer offload (``--optimizer-offload``): the option and its bad input, the offloaded
optimizer in one process (the same losses, its transfers' spans, a wait the slowed copies
force), the ``offload_stall`` finding on a hand-built run and the timeline's copy rows."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator

import pandas as pd
import pytest
import torch
from helpers.cli import assert_one_line_error, run_main
from helpers.small_run import MS, write_small_run

from analyzer.db import open_run
from analyzer.findings import analyze
from dashboard import figures_detail as D
from tracer.faults import FaultSpecError, parse_fault
from tracer.rundir import write_part
from trainer.cliconfig import resolve
from trainer.config import ModelConfig, ParallelConfig, TrainConfig
from trainer.engine import Engine
from trainer.offload import split_point
from trainer.parallel.mesh import Mesh

MODEL = ModelConfig()


# -- the option ------------------------------------------------------------------------------------
def test_the_option_sets_the_share_and_the_fault_parses():
    assert resolve(["--optimizer-offload", "0.5"]).train.optimizer_offload == 0.5
    assert resolve([]).train.optimizer_offload == 0.0
    f = parse_fault("slow_offload:rank=1,ms=40")
    assert (f.kind, f.rank, f.ms) == ("slow_offload", 1, 40.0)
    with pytest.raises(FaultSpecError, match="missing rank"):
        parse_fault("slow_offload:ms=40")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--optimizer-offload", "1.5"], "must be a fraction in [0, 1]"),
        (["--optimizer-offload", "half"], "is not a number"),
        (["--optimizer-offload", "0.5", "--checkpoint-every", "2"], "does not save checkpoints"),
    ],
)
def test_bad_offload_input_is_one_line(args, fragment):
    assert_one_line_error(run_main("train", *args, "--out", "/nonexistent/never"), fragment)


def test_offload_with_lamb_is_refused():
    with pytest.raises(ValueError, match="needs the adamw optimizer"):
        TrainConfig(optimizer="lamb", optimizer_offload=0.5)


def test_synth_refuses_the_trainers_fault(tmp_path):
    res = run_main("synth", "--mesh", "dp=2", "--steps", "4", "--inject",
                   "slow_offload:rank=1,ms=5", "--out", str(tmp_path / "s"))  # fmt: skip
    assert_one_line_error(res, "slow_offload")


def test_split_point_rounds_the_share():
    assert split_point(100, 0.5) == 50
    assert split_point(100, 0.0) == 100
    assert split_point(100, 1.0) == 0
    assert split_point(3, 0.5) == 1  # round(1.5) = 2 elements go to the host


# -- the optimizer in one process ------------------------------------------------------------------
class Hooks:
    """The engine's hooks: spans by name, transfers as recorded, and a copy that can be held
    until the training thread waits for it (``hold``): then that wait is certain."""

    def __init__(self, hold: bool = False) -> None:
        self.spans: list[str] = []
        self.records: list[dict] = []
        self.hold = hold
        self.waiting = threading.Event()

    @contextlib.contextmanager
    def span(self, name: str, kind: str = "compute", microbatch: int = -1) -> Iterator[None]:
        self.spans.append(name)
        if name == "offload_wait":
            self.waiting.set()
        yield

    def record_span(self, name, kind, start, end, **attrs) -> None:
        if isinstance(start, int):
            ns = end - start
        else:  # CUDA events on the side stream
            end.synchronize()
            ns = int(start.elapsed_time(end) * 1e6)
        self.records.append(dict(name=name, kind=kind, ns=ns, **attrs))

    def slow_copy(self) -> None:
        if self.hold and not self.waiting.wait(timeout=60):
            raise RuntimeError("the training thread never waited")


def train(
    fraction: float, hooks=None, steps: int = 4, device: str = "cpu"
) -> tuple[list[float], Engine]:
    cfg = TrainConfig(
        steps=steps,
        microbatches=2,
        optimizer_offload=fraction,
        bucket_size_mb=0.1,
        device=device,
        compile=False,
    )
    engine = Engine(MODEL, cfg, Mesh(ParallelConfig()), hooks)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        batch = torch.randint(0, MODEL.vocab_size, (2, 2, MODEL.seq_len + 1), generator=g)
        losses.append(engine.train_step(batch))
    return losses, engine


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_an_offloaded_share_trains_to_the_same_losses_and_parameters(fraction):
    ref, plain = train(0.0)
    hooks = Hooks()
    got, engine = train(fraction, hooks)
    assert got == pytest.approx(ref, rel=1e-6, abs=1e-6)
    want, have = plain.full_params(), engine.full_params()
    for name, p in want.items():
        torch.testing.assert_close(have[name], p, rtol=1e-6, atol=1e-7)
    engine.close()
    shares = engine.offload.shares
    assert len(shares) == len(engine.dp.buckets) > 1
    # every step sends each share down, updates it and brings it back, with its bytes
    want_bytes = sorted(4 * s.host_master.numel() for s in shares)
    for direction in ("d2h", "host_update", "h2d"):
        rows = [r for r in hooks.records if r["direction"] == direction]
        assert len(rows) == 4 * len(shares)
        assert {r["kind"] for r in rows} == {"offload"}
        assert sorted(r["nbytes"] for r in rows if r["step"] == 2) == want_bytes
        assert {r["stream"] for r in rows} == {"host" if direction == "host_update" else "copy"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_copies_run_on_a_side_stream_timed_by_events():
    torch.cuda.set_device(0)
    ref, _ = train(0.0, device="cuda")
    hooks = Hooks()
    got, engine = train(0.5, hooks, device="cuda")
    engine.close()
    # the device share runs torch's fused AdamW, the host share its CPU loop: equal to rounding
    assert got == pytest.approx(ref, rel=1e-4, abs=1e-5)
    assert engine.offload.shares[0].host_master.is_pinned()
    copies = [r for r in hooks.records if r["direction"] in ("d2h", "h2d")]
    assert copies and all(r["ns"] >= 0 for r in copies)


def test_a_held_copy_makes_the_next_forward_wait():
    hooks = Hooks(hold=True)
    _, engine = train(0.5, hooks, steps=2)
    engine.close()
    # the first step has nothing in flight; the second waits before it zeroes the gradients
    # or inside its forward, before the first layer's parameters are used
    first = hooks.spans.index("optimizer")
    assert "offload_wait" not in hooks.spans[:first]
    assert "offload_wait" in hooks.spans[first:]


# -- the finding on a hand-built run ---------------------------------------------------------------
def offload_run(path: str, wait_ms: float) -> str:
    """A dp2 CPU run of 8 steps in which rank 1 waits ``wait_ms`` per step on its offload,
    inside its forward, and both ranks copy 1 MB down and up beside the steps."""
    run = write_small_run(path, {"dp": 2}, steps=8, gpu=False)
    meta_path = os.path.join(run, "run.json")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["train"] = {"optimizer_offload": 0.5, "bucket_size_mb": 4.0}
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    r = open_run(run)
    fwd = r.sql("select rank, step, start_ns from spans where name = 'forward'")
    ends = r.sql("select rank, step, end_ns from spans where name = 'optimizer'")
    r.close()
    for rank in (0, 1):
        rows: list[tuple] = []
        for row in fwd[fwd["rank"] == rank].itertuples():
            if rank == 1 and row.step > 0:
                rows.append(
                    (row.step, "offload_wait", row.start_ns, wait_ms * MS, None, None, None)
                )
        for row in ends[ends["rank"] == rank].itertuples():
            t = row.end_ns
            rows += [
                (row.step, "offload_d2h", t, MS, 1 << 20, "d2h", "copy"),
                (row.step, "offload_update", t + MS, 2 * MS, 1 << 20, "host_update", "host"),
                (row.step, "offload_h2d", t + 3 * MS, MS, 1 << 20, "h2d", "copy"),
            ]
        cols = {
            "rank": [rank] * len(rows),
            "step": [int(r[0]) for r in rows],
            "microbatch": [-1] * len(rows),
            "name": [r[1] for r in rows],
            "kind": ["offload"] * len(rows),
            "start_ns": [int(r[2]) for r in rows],
            "end_ns": [int(r[2] + r[3]) for r in rows],
            "source": ["host"] * len(rows),
            "nbytes": [r[4] for r in rows],
            "direction": [r[5] for r in rows],
            "stream": [r[6] for r in rows],
        }
        write_part(run, "spans", rank, cols)
    return run


def test_offload_stall_names_the_waiting_rank_and_prices_its_wait(tmp_path):
    run = offload_run(str(tmp_path / "slow"), wait_ms=20)
    rep = analyze(open_run(run), whatif=False)
    found = [f for f in rep["findings"] if f["kind"] == "offload_stall"]
    assert len(found) == 1, rep["findings"]
    f, ev = found[0], found[0]["evidence"]
    assert f["ranks"] == [1]
    assert ev["stall_ms_per_step"] == 20.0 and ev["saved_ms_per_step"] == 20.0
    assert ev["whatif_step_ms"] == pytest.approx(ev["step_ms"] - 20.0, abs=1e-3)
    assert f["severity"] == pytest.approx(20.0 / ev["step_ms"], abs=1e-3)
    assert (ev["d2h_ms"], ev["host_update_ms"], ev["h2d_ms"]) == (1.0, 2.0, 1.0)
    assert ev["bytes_per_step"] == 1 << 20
    assert ev["fraction"] == 0.5 and ev["hide_with_fraction"] == 0.0  # nothing was hidden
    assert ev["hide_with_bucket_size_mb"] == 2.0


def test_a_short_wait_is_no_offload_stall(tmp_path):
    run = offload_run(str(tmp_path / "ok"), wait_ms=0.1)
    rep = analyze(open_run(run), whatif=False)
    assert "offload_stall" not in {f["kind"] for f in rep["findings"] + rep["dismissed"]}


def test_a_run_without_offload_reads_no_offload_spans(tmp_path):
    run = write_small_run(str(tmp_path / "plain"), {"dp": 2}, steps=6, gpu=False)
    rep = analyze(open_run(run), whatif=False)
    assert "offload_stall" not in {f["kind"] for f in rep["findings"]}


# -- the timeline --------------------------------------------------------------------------------
def test_the_timeline_draws_the_copies_on_their_stream():
    spans = pd.DataFrame(
        dict(
            rank=[0, 0, 0],
            microbatch=[0, -1, -1],
            name=["forward", "offload_d2h", "offload_update"],
            kind=["compute", "offload", "offload"],
            start_ns=[0, 2 * MS, 3 * MS],
            end_ns=[9 * MS, 3 * MS, 5 * MS],
            nbytes=[None, 4096, 4096],
            direction=[None, "d2h", "host_update"],
            stream=[None, "copy", "host"],
        )
    )
    colls = pd.DataFrame(columns=["rank", "op", "group_name", "gid", "src", "dst", "seq",
                                  "start_ns", "end_ns"])  # fmt: skip
    topo = pd.DataFrame(dict(rank=[0], dp=[0], pp=[0], tp=[0], cp=[0]))
    fig = D.timeline(spans, colls, topo, step=0, ranks=[0])
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["offload: d2h"].y) == ["r0 dp0 pp0 tp0 · copy"]
    assert list(by_name["offload: d2h"].base) == [2.0] and list(by_name["offload: d2h"].x) == [1.0]
    assert "4,096 bytes" in by_name["offload: host_update"].hovertext[0]
    assert list(fig.layout.yaxis.categoryarray) == [
        "r0 dp0 pp0 tp0 · host",
        "r0 dp0 pp0 tp0 · copy",
        "r0 dp0 pp0 tp0",
    ]
