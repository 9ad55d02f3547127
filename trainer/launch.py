"""``megascope train``: validate, write run.json, run torchrun, watch it, end the run cleanly.

The launcher is the one process that sees every rank from outside, so it owns the run's fate:

1. Every flag, the TOML file and every ``--inject`` spec are checked before any process
   starts (:mod:`trainer.cliconfig`); a problem is one line and exit 2.
2. ``run.json`` is written (status ``running``) and the resolved configuration is left in
   ``RUN/.progress/launch.json`` for the ranks (hidden files are not tables).
3. ``python -m torch.distributed.run ... -m trainer.train RUN`` starts in its own
   session. Each rank rewrites ``RUN/.progress/rank-RRRRR`` (``pid step ns state``) as it
   starts, when it is ready and after every step.
4. The launcher polls. torchrun exiting ends the run (0: finished; else a rank died and
   torchrun tore the others down: failed). A rank whose progress file has not changed for
   ``--hang-timeout`` seconds (a longer grace while ranks start up) means a hang: the
   launcher gives the tracer's own watchdog two seconds to record its rank's stack, takes
   ``py-spy dump`` stacks of every rank that has none, SIGTERMs the ranks (the tracer flushes
   on SIGTERM), SIGKILLs what is left a few seconds later and marks the run ``hung``. Ctrl-C
   (or SIGTERM to the launcher) tears down the same way and marks it ``failed``.
5. ``run.json`` is rewritten with the status, ``ended_at`` and a summary computed from the
   per-step losses and times rank 0 appended to ``RUN/.progress/steps.jsonl``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from tracer.cliutil import UsageError, fail
from tracer.rundir import base_run_json, mesh_groups, now_iso, read_run_json, write_json_atomic
from trainer import progress
from trainer.cliconfig import LaunchConfig, resolve

log = logging.getLogger("megascope.train")

STARTUP_GRACE_S = 300.0  # silence allowed while a rank imports torch, joins and builds its model
TRACER_STACK_WAIT_S = 2.0  # the tracer's watchdog takes its own stack at the same timeout
TERM_GRACE_S = 3.0  # SIGTERM to SIGKILL
POLL_S = 0.2


class _Terminated(Exception):
    """The launcher itself got SIGTERM: tear down like Ctrl-C."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_command(cfg: LaunchConfig, port: int) -> list[str]:
    """The torchrun command line for this node (static rendezvous, no restarts)."""
    run = cfg.run
    addr, master_port = "127.0.0.1", str(port)
    if run.rdzv_endpoint:
        addr, _, master_port = run.rdzv_endpoint.rpartition(":")
        if not addr or not master_port.isdigit():
            raise UsageError(f"--rdzv-endpoint {run.rdzv_endpoint!r} must be HOST:PORT")
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={cfg.world_size // run.nnodes}",
        f"--nnodes={run.nnodes}",
        f"--node-rank={run.node_rank}",
        f"--master-addr={addr}",
        f"--master-port={master_port}",
        "--max-restarts=0",
        "--monitor-interval=0.1",
        "-m",
        "trainer.train",
        os.path.abspath(run.out),
    ]


def _versions() -> dict[str, Any]:
    import torch

    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # NCCL absent from this build
            nccl = None
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "python": sys.version.split()[0],
    }


def _tracer_settings(cfg: LaunchConfig) -> dict[str, Any]:
    if not cfg.run.trace:
        return {"enabled": False}
    try:
        from trainer.train import tracer_config

        return {"enabled": True, **tracer_config(cfg).as_dict()}
    except (ImportError, ValueError) as e:
        raise UsageError(f"tracer settings: {e}") from None


def prepare_run(cfg: LaunchConfig) -> dict[str, Any]:
    """Check the run directory, write run.json and the ranks' launch.json; return run.json."""
    from trainer.checkpoint import latest_complete

    out = cfg.run.out
    existing = os.path.exists(os.path.join(out, "run.json"))
    resumed_from, old = None, {}
    if cfg.run.resume:
        if not existing:
            raise UsageError(f"--resume: {out} holds no run to resume")
        old = read_run_json(out)
        if old.get("mesh") != cfg.parallel.sizes:
            raise UsageError(f"--resume: {out} was run with mesh {old.get('mesh')}")
        resumed_from = latest_complete(out, cfg.world_size)
        if resumed_from is None:
            raise UsageError(f"--resume: {out} has no complete checkpoint")
        if resumed_from >= min(cfg.train.steps, cfg.run.stop_after or cfg.train.steps):
            raise UsageError(f"--resume: {out} is already at step {resumed_from}; raise --steps")
    elif existing:
        raise UsageError(f"{out} already holds a run (pass --resume, or choose another --out)")
    os.makedirs(progress.progress_dir(out), exist_ok=True)
    progress.clear_ranks(out)
    meta = base_run_json(
        run_id=old.get("run_id") if cfg.run.resume else None,
        world_size=cfg.world_size,
        mesh=cfg.parallel.sizes,
        groups=mesh_groups(cfg.parallel.sizes),
        device=cfg.train.device,
        model={"config": cfg.to_mapping()["model"], "params": None, "flops_per_token": None},
        tracer=_tracer_settings(cfg),
        injections=cfg.run.injections,
        versions=_versions(),
    )
    meta["parallel"] = cfg.to_mapping()["parallel"]
    meta["train"] = cfg.to_mapping()["train"]
    if resumed_from is not None:  # the run keeps its identity and start; the launch is new
        meta["started_at"] = old.get("started_at", meta["started_at"])
        meta["resumed_at"] = now_iso()
        meta["resumed_from_step"] = resumed_from
    write_json_atomic(os.path.join(progress.progress_dir(out), "launch.json"), cfg.to_mapping())
    write_json_atomic(os.path.join(out, "run.json"), meta)
    return meta


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``megascope train``; returns the exit status."""
    try:
        cfg = resolve(list(sys.argv[1:] if argv is None else argv))
        cmd = torchrun_command(cfg, free_port())
        meta = prepare_run(cfg)
    except UsageError as e:
        fail(str(e))
    logging.basicConfig(
        level=logging.INFO, format="[launcher] %(asctime)s %(message)s", datefmt="%H:%M:%S"
    )
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    log.info(
        "run %s: %d ranks %s -> %s", meta["run_id"], cfg.world_size, cfg.parallel.sizes, cfg.run.out
    )
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        status, code = Supervisor(cfg, proc).watch()
    finally:
        signal.signal(signal.SIGTERM, previous)
    meta = read_run_json(cfg.run.out)
    meta.update(progress.read_model_report(cfg.run.out, meta))
    meta["status"] = status
    meta["ended_at"] = now_iso()
    meta["summary"] = progress.summarize(cfg, progress.read_steps(cfg.run.out), meta)
    write_json_atomic(os.path.join(cfg.run.out, "run.json"), meta)
    log.info("run %s %s: %s", meta["run_id"], status, json.dumps(meta["summary"]))
    return code


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated()


class Supervisor:
    """Watches torchrun and the ranks' progress files; ends the run on a hang or Ctrl-C."""

    def __init__(self, cfg: LaunchConfig, proc: subprocess.Popen) -> None:
        self.cfg = cfg
        self.proc = proc
        self.run_dir = cfg.run.out
        self.started = time.monotonic()
        # rank -> (last line seen, monotonic time it changed)
        self.seen: dict[int, tuple[str, float]] = {}
        self.pids: dict[int, int] = {}

    def watch(self) -> tuple[str, int]:
        """Poll until torchrun exits or a hang is seen; return (status, exit code)."""
        try:
            while True:
                code = self.proc.poll()
                if code is not None:
                    log.info("torchrun exited with status %d", code)
                    if code == 0:
                        return "finished", 0
                    log.error("torchrun exited with status %d: the run failed", code)
                    return "failed", code if code > 0 else 1
                stalled = self._stalled()
                if stalled:
                    self._end_hang(stalled)
                    return "hung", 3
                time.sleep(POLL_S)
        except (KeyboardInterrupt, _Terminated):
            log.error("interrupted: stopping the ranks")
            self.teardown()
            return "failed", 130

    def _stalled(self) -> list[int]:
        """Ranks whose progress line has not changed for longer than they are allowed."""
        now = time.monotonic()
        lines = progress.read_ranks(self.run_dir)
        for rank, line in lines.items():
            if self.seen.get(rank, ("", 0.0))[0] != line.raw:
                self.seen[rank] = (line.raw, now)
                self.pids[rank] = line.pid
        local = self.cfg.world_size // self.cfg.run.nnodes
        first = self.cfg.run.node_rank * local
        stalled = []
        for rank in range(first, first + local):
            raw, since = self.seen.get(rank, ("", self.started))
            state = lines[rank].state if rank in lines else "absent"
            allowed = self.cfg.run.hang_timeout
            # importing torch, joining and building the model (and compiling during the
            # first step) may take longer than a step: a grace while ranks start up
            if state in ("absent", "start") or (state == "ready" and self.cfg.train.compile):
                allowed = max(allowed, STARTUP_GRACE_S)
            if now - since > allowed:
                stalled.append(rank)
        return stalled

    def _end_hang(self, stalled: list[int]) -> None:
        steps = {r: progress.read_ranks(self.run_dir).get(r) for r in stalled}
        log.error(
            "hang: no progress from ranks %s for %.0f s (last steps %s); taking stacks",
            stalled,
            self.cfg.run.hang_timeout,
            {r: (s.step if s else None) for r, s in steps.items()},
        )
        if self.cfg.run.trace:
            time.sleep(TRACER_STACK_WAIT_S)
        for rank, pid in sorted(self.pids.items()):
            if not progress.has_own_stack(self.run_dir, rank):
                progress.dump_to_run(self.run_dir, rank, pid, reason="hang")
        self.teardown()

    def _worker_pids(self) -> set[int]:
        pids = set(self.pids.values())
        pids.update(progress.children(self.proc.pid))
        pids.discard(os.getpid())
        return pids

    def teardown(self) -> None:
        """SIGTERM every rank and torchrun, SIGKILL what is still alive after a grace."""
        workers = self._worker_pids()
        for pid in workers:
            _signal(pid, signal.SIGTERM)
        _signal(self.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and not any(_alive(p) for p in workers):
                break
            time.sleep(0.1)
        for pid in workers | self._worker_pids():
            if _alive(pid):
                _signal(pid, signal.SIGKILL, group=True)
        if self.proc.poll() is None:
            _signal(self.proc.pid, signal.SIGKILL, group=True)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.error("torchrun (pid %d) did not exit after SIGKILL", self.proc.pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return False


def _signal(pid: int, sig: signal.Signals, group: bool = False) -> None:
    """Send ``sig`` to ``pid`` (and its process group, which torchrun gives each rank)."""
    try:
        if group and os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
