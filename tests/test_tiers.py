"""The two tiers hold: what starts ranks is told from what does not, and a test outside the
live tier that starts ranks fails before anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.tiers import StartsRanks, runs_alone, starts_ranks


@pytest.mark.parametrize(
    "argv",
    [
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "x.py"],
        ["/usr/local/bin/torchrun", "--nproc-per-node=2", "-m", "tracer.run", "x.py"],
        [sys.executable, "-m", "trainer", "--dp", "2"],
        [sys.executable, "-m", "analyzer", "train", "--dp", "2", "--out", "r"],
        [sys.executable, "-m", "analyzer", "demo", "--no-serve"],
        ["/usr/bin/chromium", "--headless"],
        ["/site-packages/playwright/driver/node", "cli.js", "run-driver"],
    ],
)
def test_what_starts_ranks_is_named(argv):
    assert starts_ranks(argv)


@pytest.mark.parametrize(
    "argv",
    [
        [sys.executable, "-m", "analyzer", "analyze", "/tmp/test_torchrun_train_chromium/run"],
        [sys.executable, "-m", "analyzer", "dashboard", "--port", "0", "run"],
        [sys.executable, "-m", "analyzer", "synth", "--mesh", "dp=2", "--out", "train"],
        [sys.executable, "-m", "tracer.run"],
        ["py-spy", "dump", "--pid", "1"],
        "ldconfig -p",
    ],
)
def test_other_commands_are_not_ranks(argv):
    assert starts_ranks(argv) is None


def test_a_default_tier_test_that_starts_ranks_fails_before_they_start(tmp_path):
    marker = tmp_path / "started"
    cmd = [sys.executable, "-m", "torch.distributed.run", "-c", f"open('{marker}', 'w')"]
    with pytest.raises(StartsRanks, match="not in the live tier"):
        subprocess.Popen(cmd)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("markexpr", "alone"),
    [
        ("", True),
        ("live", True),
        ("solo", True),
        ("live and not gpu", True),
        ("(live) and not gpu", True),
        ("live and solo", True),
        ("not live", False),
        ("live and not solo", False),
        ("(live and not solo) and not gpu", False),
    ],
)
def test_an_expression_that_can_select_a_solo_test_runs_in_one_process(markexpr, alone):
    assert runs_alone(markexpr) is alone
