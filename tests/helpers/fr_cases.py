"""Flight Recorder sets with known culprits, made by real processes on gloo.

Each :class:`Case` runs either megascope's own trainer (``megascope train``, dp2 x pp2 x tp2,
traced, with a fault of its own or one of the harness in ``tests/scripts/frharness``) or the
expert-parallel job ``tests/scripts/fr_ep_job.py`` (torchrun), with every rank dumping its Flight
Recorder a few times a second (the harness), and leaves a folder of dumps, one per rank, plus
``fault_injection.log`` (the ground truth, in the format of the NVIDIA sets: ``Fault ranks:
[5]``). A killed rank leaves no dump when ``drop`` says so (a dead process writes none).

``PYTHONPATH=tests python -m helpers.fr_cases OUT [NAME...]`` writes the sets (gzip-compressed dumps) under
``OUT/NAME``; ``tests/data/flight_recorder`` holds the ones listed in ``tests/data/README.md``.
"""

from __future__ import annotations

import gzip
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from helpers.net import free_port
from helpers.paths import ROOT as REPO
from helpers.paths import SCRIPTS

HARNESS = os.path.join(SCRIPTS, "frharness")
PYTHON = sys.executable


@dataclass(frozen=True)
class Case:
    name: str
    culprits: tuple[int, ...]
    job: str = "trainer"  # trainer | ep
    inject: str = ""  # megascope train --inject
    fault: str = ""  # harness (trainer) or EP_FAULT (ep)
    fmt: str = "json"  # json | pickle
    drop: tuple[int, ...] = ()  # ranks whose dump is removed (dead processes write none)
    what: str = ""


CASES = {
    c.name: c
    for c in [
        Case("trainer_hang", (5,), inject="hang:rank=5,step=3",
             what="rank 5 blocks in compute before its next tp collective at step 3"),
        Case("trainer_crash", (2,), inject="crash:rank=2,step=3", fmt="pickle", drop=(2,),
             what="rank 2 exits abruptly at step 3 (no dump of its own)"),
        Case("trainer_gil", (6,), fault="gil:rank=6,call=100",
             what="a thread of rank 6 takes the GIL for good just after its 100th tp collective "
                  "(its last dump is from before)"),
        Case("trainer_kill_in_tp", (3,), fault="kill:rank=3,call=90", fmt="pickle", drop=(3,),
             what="rank 3 is SIGKILLed inside its 90th tp collective (no dump of its own)"),
        Case("ep_hang", (6,), job="ep", fault="hang:rank=6,iter=3",
             what="rank 6 blocks before an expert all_to_all"),
        Case("ep_kill", (1,), job="ep", fault="kill:rank=1,iter=2", fmt="pickle", drop=(1,),
             what="rank 1 is SIGKILLed inside an expert all_to_all (no dump of its own)"),
        Case("ep_gil", (4,), job="ep", fault="gil:rank=4,iter=3",
             what="rank 4 holds the GIL before an expert all_to_all"),
    ]
}  # fmt: skip


def _env(fr_dir: str, case: Case, buffer: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HARNESS, REPO, env.get("PYTHONPATH")) if p)
    env.update(
        MEGASCOPE_FR_DIR=fr_dir,
        MEGASCOPE_FR_FORMAT=case.fmt,
        MEGASCOPE_FR_EVERY="0.1",
        TORCH_FR_BUFFER_SIZE=str(buffer),
        OMP_NUM_THREADS="1",
    )
    if case.job == "trainer" and case.fault:
        env.update(MEGASCOPE_FR_FAULT=case.fault, MEGASCOPE_FR_TP="2")
    return env


def _run_trainer(case: Case, work: str, env: dict[str, str]) -> str:
    run = os.path.join(work, "run")
    cmd = [PYTHON, "-m", "analyzer", "train", "--dp", "2", "--pp", "2", "--tp", "2",
           "--steps", "8", "--device", "cpu", "--hang-timeout", "10", "--out", run]  # fmt: skip
    if case.inject:
        cmd += ["--inject", case.inject]
    subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, timeout=900)
    return run


def _run_ep(case: Case, work: str, env: dict[str, str], settle_s: float = 6.0) -> None:
    mark = os.path.join(work, "fault-fired")
    env = dict(env, EP_FAULT=case.fault, EP_MARK=mark, EP_ITERS="8")
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node=8", "--max-restarts=0",
           "--monitor-interval=0.1", f"--master-port={free_port()}",
           os.path.join(SCRIPTS, "fr_ep_job.py")]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if os.path.exists(mark):
                time.sleep(settle_s)  # the others block; their dumps show where
                break
            time.sleep(0.2)
    finally:
        _kill_tree(proc.pid)
        proc.wait(timeout=60)


def _tree(root: int) -> list[int]:
    """``root`` and every process descended from it."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parent[int(name)] = int(fields[1])
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += [c for c, p in parent.items() if p == pid]
    return out


def _kill_tree(root: int) -> None:
    """SIGKILL torchrun and every rank it started (a stopped rank is first resumed)."""
    pids = _tree(root)
    for sig in (signal.SIGCONT, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids[1:]):
        time.sleep(0.1)


def make(case: Case, out: str, buffer: int = 256, keep_run: str | None = None) -> str:
    """Run ``case`` and write its set to ``out`` (created); returns ``out``.

    ``keep_run``: where to move the trainer's traced run directory (None: dropped).
    """
    with tempfile.TemporaryDirectory(prefix=f"fr-{case.name}-") as work:
        fr_dir = os.path.join(work, "fr")
        env = _env(fr_dir, case, buffer)
        if case.job == "trainer":
            run = _run_trainer(case, work, env)
            if keep_run:
                shutil.move(run, keep_run)
        else:
            _run_ep(case, work, env)
        os.makedirs(out, exist_ok=True)
        for name in sorted(os.listdir(fr_dir)) if os.path.isdir(fr_dir) else []:
            if name.endswith(".tmp"):
                continue
            rank = int("".join(c for c in name.split(".")[0] if c.isdigit()))
            if rank in case.drop:
                continue
            with open(os.path.join(fr_dir, name), "rb") as f:
                data = f.read()
            with open(os.path.join(out, name + ".gz"), "wb") as f:
                f.write(gzip.compress(data, mtime=0))
    with open(os.path.join(out, "fault_injection.log"), "w") as f:
        f.write(f"Fault ranks: {list(case.culprits)}\n")
        f.write(f"Job: {case.job}; fault: {case.inject or case.fault}; {case.what}\n")
    return out


def truth(set_dir: str) -> list[int] | None:
    """The culprits a set's ``fault_injection.log`` names (None when it has none)."""
    path = os.path.join(set_dir, "fault_injection.log")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        for line in f:
            if line.startswith("Fault ranks:"):
                inner = line.split(":", 1)[1].strip().strip("[]")
                return sorted(int(x) for x in inner.split(",") if x.strip())
    return None


def main(argv: list[str]) -> int:
    runs = "--runs" in argv  # also keep the trainer's traced run as OUT/NAME.run
    argv = [a for a in argv if a != "--runs"]
    out, names = argv[0], argv[1:] or list(CASES)
    for name in names:
        t = time.monotonic()
        keep = os.path.join(out, f"{name}.run") if runs and CASES[name].job == "trainer" else None
        make(CASES[name], os.path.join(out, name), keep_run=keep)
        print(f"{name}: {time.monotonic() - t:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
