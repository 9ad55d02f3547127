"""A ``torch.distributed.pipelining`` schedule traced unmodified on 4 gloo ranks: its layout is
read from its process groups (analyzer/meshinfer.py), not taken for data parallelism.

examples/pipelining.py runs ``torchrun -m tracer.run`` with 2 stages x 2 replicas over its own
``new_group`` calls or over an unnamed DeviceMesh, and with 4 stages on the default group. (A
DeviceMesh with named dimensions is read by the tracer itself, tracer/meshinfo.py: the
examples' FSDP2 x TP script, tests/test_examples.py.)
"""

from __future__ import annotations

import pytest
from helpers.live import SMALL

from analyzer.db import open_run
from analyzer.findings import analyze
from analyzer.render.words import headline

CASES = [
    (("--pp", "2"), "dp=2 x pp=2", [0, 1, 0, 1]),
    (("--pp", "2", "--groups", "mesh-unnamed"), "dp=2 x pp=2", [0, 1, 0, 1]),
    (("--pp", "4", "--layers", "4"), "pp=4", [0, 1, 2, 3]),
]


@pytest.mark.live
@pytest.mark.parametrize(("args", "layout", "stages"), CASES, ids=lambda v: str(v))
def test_a_pipelining_schedule_reads_as_its_layout(attach, tmp_path, args, layout, stages):
    run = str(tmp_path / "run")
    done = attach(run, "pipelining.py", *args, steps=6, size=SMALL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    db = open_run(run)
    try:
        report = analyze(db)
        coords = db.sql("select rank, pp from rank_coords order by rank")
    finally:
        db.close()
    assert headline(report).startswith(f"4 ranks ({layout})"), headline(report)
    # peers are the ranks of the same stage
    assert coords["pp"].tolist() == stages
