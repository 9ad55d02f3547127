"""A compiled data-parallel model and DDP's bucket all-reduces, traced on real gloo ranks.

examples/compiled_ddp.py is ``torch.compile(DDP(model))`` (inductor on CPU), run unmodified as
``torchrun --nproc-per-node 4 -m tracer.run examples/compiled_ddp.py``. DDP's reducer issues its
all-reduces from C++, compiled or not; the tracer times them through a comm hook
(tracer/ddpcomm.py): a peer's wait for a slow rank is inside its all-reduce rows. The first steps
compile (seconds each); the slow rank is slowed from step 4 on, by computing or by sleeping.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from helpers.live import ALARMS, SMALL
from helpers.net import free_port
from helpers.paths import EXAMPLES, ROOT
from helpers.report import explain
from helpers.tables import QUIET

import tracer
from analyzer.db import open_run
from analyzer.findings import analyze

pytestmark = pytest.mark.live

STEPS = 16
SLOW = 2


def _breaks(stdout: str) -> int:
    """The graph breaks the script printed (torch's count)."""
    found = re.search(r"graph breaks (\d+)", stdout)
    assert found is not None, stdout
    return int(found.group(1))


@pytest.fixture(scope="module")
def untraced_breaks() -> int:
    """The graph breaks of the script without the tracer (DDP's forward has some of its own),
    on one rank, two steps."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
           f"--master-port={free_port()}", os.path.join(EXAMPLES, "compiled_ddp.py"),
           "--steps", "2", *SMALL]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGASCOPE")}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return _breaks(done.stdout)


def _traced(attach, run: str, breaks: int, *args: str) -> dict:
    """The script traced to its end (the tracer adds no graph break), the DDP all-reduce rows
    checked; the diagnosis and the all-reduces' median time per rank past the compiling
    steps."""
    done = attach(run, "compiled_ddp.py", *args, steps=STEPS, size=SMALL, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert _breaks(done.stdout) == breaks, done.stdout
    db = open_run(run)
    try:
        ar = db.sql(
            "select rank, count(distinct step) as steps, count(*) filter (where source <> 'host') "
            "as other, median(end_ns - start_ns) / 1e6 as wait_ms from collectives "
            "where op = 'all_reduce' and group_size = 4 and step >= 4 group by rank order by rank"
        )
        assert list(ar["steps"]) == [STEPS - 4] * 4, ar
        assert list(ar["other"]) == [0] * 4, ar  # every one timed by the hook, none untimed
        report = analyze(db)
    finally:
        db.close()
    return {"report": report, "wait_ms": dict(zip(ar["rank"], ar["wait_ms"], strict=True))}


@pytest.mark.solo
def test_a_compiled_run_names_its_slow_rank(attach, tmp_path, untraced_breaks):
    """Slowed by sleeping, the harder case (its CPU time is its peers'); a rank that burns is
    the plain scripts' (tests/test_examples.py), and both kinds at 1.5x are the bench's
    (bench/framework_accuracy.py --script compiled_ddp --slow-by burn|sleep)."""
    run = str(tmp_path / "run")
    out = _traced(
        attach,
        run,
        untraced_breaks,
        "--slow-rank",
        str(SLOW),
        "--slow-factor",
        "1.5",
        "--slow-mode",
        "sleep",
    )
    report, waits = out["report"], out["wait_ms"]
    # the peers wait for the slow rank inside their all-reduces; it hardly waits
    assert all(waits[r] > 0 for r in range(4) if r != SLOW), waits
    assert min(waits[r] for r in range(4) if r != SLOW) > waits[SLOW], waits
    assert report["findings"], explain(report, run)
    top = report["findings"][0]
    assert (top["kind"], top["ranks"]) == ("straggler", [SLOW]), explain(report)


@pytest.mark.solo
def test_a_healthy_compiled_run_raises_nothing(attach, tmp_path, untraced_breaks):
    run = str(tmp_path / "run")
    report = _traced(attach, run, untraced_breaks)["report"]
    alarms = ALARMS | {"regression"}  # the compiling steps are no regression either
    assert not [f for f in report["findings"] if f["kind"] in alarms], explain(report)


def _hooked(rank: int, world: int, run: str) -> dict:
    """Plain DDP with a comm hook of the script's own, registered after attach: it runs (inside
    the tracer's), the gradients are averaged, and each all-reduce is one timed row."""
    import time

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    tracer.attach(run, config=QUIET)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1)), bucket_cap_mb=0.01)
    calls = []

    def mine(state, bucket):
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(dist.group.WORLD, mine)
    x = torch.full((8, 64), float(rank + 1))
    for step in range(3):
        tracer.step(step)
        loss = model(x).sum()
        if rank == 1:
            time.sleep(0.2)  # the peer waits for it in the backward's all-reduces
        loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    tracer.close()
    # the average of both ranks' gradients: the same on both, as without a hook
    both = [torch.empty_like(g) for g in grads]
    for g, b in zip(grads, both, strict=True):
        dist.all_reduce(b.copy_(g))
    same = all(torch.allclose(2 * g, b) for g, b in zip(grads, both, strict=True))
    return {"calls": len(calls), "same": same}


def test_ddp_all_reduces_are_timed_and_a_scripts_own_hook_runs(tmp_path, ranks):
    run = str(tmp_path / "run")
    out = ranks(_hooked, 2, run)
    assert all(o["same"] for o in out), out
    assert out[0]["calls"] == out[1]["calls"] >= 3, out
    db = open_run(run)
    try:
        rows = db.sql(
            "select rank, step, source, (end_ns - start_ns) / 1e6 as ms, end_ns >= issue_ns as ok "
            "from collectives where op = 'all_reduce' and step >= 0"
        )
    finally:
        db.close()
    assert set(rows["source"]) == {"host"} and rows["ok"].all(), rows
    assert len(rows) == 2 * out[0]["calls"], rows
    # rank 0 waits about 0.2 s a step for rank 1, inside its all-reduces; rank 1 hardly
    waited = rows[rows["rank"] == 0].groupby("step")["ms"].max()
    assert (waited > 100).all(), rows
    assert rows[rows["rank"] == 1]["ms"].max() < waited.min(), rows
