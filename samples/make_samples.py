"""Regenerate the sample runs: small real CPU runs of megascope's trainer with known faults.

    python samples/make_samples.py [--only NAME ...]

Each sample is a run directory made by `megascope train` on 8 gloo ranks (dp2 x pp2 x tp2 with
sequence parallel), traced, with the fault in its name injected; checkpoints and the launcher's
progress files are removed so every sample stays well under 1 MB. Tests and the dashboard read
them; `injections` in each run.json is the ground truth.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MESH = ["--dp", "2", "--pp", "2", "--tp", "2", "--sp", "--device", "cpu"]

# name -> (extra train flags, whether the run is expected to end non-zero)
SAMPLES: dict[str, tuple[list[str], bool]] = {
    "healthy": (["--steps", "20"], False),
    "slow_rank": (["--steps", "20", "--inject", "slow_rank:rank=5,factor=1.6"], False),
    "slow_link": (["--steps", "20", "--inject", "slow_link:ranks=1-5,factor=8"], False),
    "hang": (["--steps", "20", "--inject", "hang:rank=6,step=8", "--hang-timeout", "10"], True),
    "crash": (["--steps", "20", "--inject", "crash:rank=3,step=8", "--hang-timeout", "20"], True),
}

# What a sample keeps: the SPEC tables and run.json; the rest is launcher/trainer scratch.
KEEP = {"run.json", "topology", "spans", "collectives", "gpu", "heartbeats", "stacks"}


def make(name: str) -> None:
    flags, may_fail = SAMPLES[name]
    out = os.path.join(HERE, name)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "analyzer", "train", *MESH, *flags, "--out", out]
    print("$", " ".join(cmd[2:]), flush=True)
    rc = subprocess.call(cmd)
    if (rc != 0) != may_fail:
        raise SystemExit(f"sample {name}: train exited {rc}, expected {'non-zero' if may_fail else 0}")
    for entry in os.listdir(out):
        if entry not in KEEP:
            path = os.path.join(out, entry)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    size = sum(
        os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(out) for f in files
    )
    print(f"sample {name}: {size / 1024:.0f} KiB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(SAMPLES), default=sorted(SAMPLES))
    for name in parser.parse_args().only:
        make(name)


if __name__ == "__main__":
    main()
