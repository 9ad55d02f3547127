"""``megascope watch`` on a real run while it trains: a rank made slow from step 12 on is
announced as the straggler within 10 steps, and /metrics answers with per-rank series."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest
from distributed import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAULT_STEP = 12


def megascope(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "analyzer", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip


@pytest.mark.slow
def test_watch_announces_a_straggler_as_it_appears_and_serves_metrics(tmp_path):
    run, port = str(tmp_path / "run"), free_port()
    watcher = megascope("watch", run, "--interval", "1", "--window", "10",
                        "--metrics-port", str(port), "--no-whatif")  # fmt: skip
    train = megascope("train", "--dp", "2", "--tp", "2", "--steps", "40", "--out", run,
                      "--inject", f"slow_rank:rank=1,factor=2,step={FAULT_STEP}")  # fmt: skip
    metrics = ""
    try:
        deadline = time.monotonic() + 240
        while train.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    body = r.read().decode()
                if 'megascope_rank_compute_seconds{rank="1"}' in body:
                    metrics = body
            except OSError:
                pass
            time.sleep(1)
        assert train.wait(timeout=60) == 0, train.stdout.read()
        out, _ = watcher.communicate(timeout=120)
    finally:
        for p in (train, watcher):
            if p.poll() is None:
                p.kill()
    assert watcher.returncode in (0, 3), out
    appeared = re.findall(r"steps (\d+)-(\d+): \+ straggler 1 ", out)
    assert appeared, out
    lo, hi = map(int, appeared[0])
    assert FAULT_STEP <= hi <= FAULT_STEP + 10, out  # named within 10 steps of the fault
    assert not re.search(r"\+ straggler (0|2|3) ", out), out
    assert 'megascope_findings{kind="straggler"}' in metrics
    for rank in range(4):
        assert f'megascope_rank_compute_seconds{{rank="{rank}"}}' in metrics
    assert re.search(r"^megascope_last_step \d", metrics, re.M)
