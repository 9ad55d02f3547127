"""A rank that sleeps its extra time, as a host waiting on a slow device, disk or link: attached
unmodified, it is named from its own time (wall step time less its waits for peers), not
dismissed, though its training thread's CPU time is its peers' (issue 47).

examples/ddp.py on 4 gloo ranks with ``--slow-mode sleep`` (examples/common.py's Faults,
examples/slowdown.py's ``mode="sleep"``). 2x: the rank is named however 4 ranks share 2 cores;
the other scripts slowed by sleeping, what the detector reads back of 1.5x, and the severity
against twin runs are measured in bench/framework_accuracy.py ``--slow-by sleep``. The healthy
ddp.py is tests/test_examples.py's (a script slows by sleeping only where told to).
"""

from __future__ import annotations

import pytest
from helpers.report import diagnose, shown

pytestmark = pytest.mark.live

STEPS = 30


def report_of(attach, tmp_path, script: str, *args: str) -> dict:
    run = str(tmp_path / "run")
    done = attach(run, script, "--slow-mode", "sleep", *args, steps=STEPS)
    assert done.returncode == 0, done.stdout + done.stderr
    return diagnose(run)


@pytest.mark.solo
def test_a_sleeping_rank_is_named_not_dismissed(attach, tmp_path):
    report = report_of(attach, tmp_path, "ddp.py", "--slow-rank", "2", "--slow-factor", "2")
    stragglers = [f for f in report["findings"] if f["kind"] == "straggler"]
    assert [f["ranks"] for f in stragglers][:1] == [[2]], shown(report)
    assert stragglers[0]["severity"] > 0, shown(report)
    assert not [d for d in report["dismissed"] if d["ranks"] == [2]], shown(report)
