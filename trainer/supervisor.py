"""The launcher's watch over torchrun and its ranks: torchrun exiting ends the run; a rank whose
progress stands still past ``--hang-timeout`` is a hang (stacks first, then SIGTERM, then
SIGKILL); Ctrl-C or SIGTERM to the launcher tears the ranks down the same way.

A rank's progress is the newer of its progress file and the line it last sent to the launcher's
:class:`~tracer.beacon.Listener`: a rank whose progress writer turned off (its disk full,
read-only, gone) goes on sending its lines, so it is not taken for hung. The same datagrams
carry the writers' failures (``storage_failed``) and the missing checkpoints, which the
launcher writes into the run's status."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time

from tracer.beacon import Listener
from trainer import progress
from trainer.cliconfig import LaunchConfig
from trainer.nodes import POLL_S, local_ranks

log = logging.getLogger("megascope.train")

STARTUP_GRACE_S = 300.0  # silence allowed while a rank imports torch, joins and builds its model
TRACER_STACK_WAIT_S = 2.0  # the tracer's watchdog takes its own stack at the same timeout
TERM_GRACE_S = 3.0  # SIGTERM to SIGKILL


class Terminated(Exception):
    """The launcher itself got SIGTERM: tear down like Ctrl-C."""


def raise_terminated(signum: int, frame: object) -> None:
    """SIGTERM's handler: raise :class:`Terminated`."""
    raise Terminated()


class Supervisor:
    """Watches torchrun and the ranks' progress files; ends the run on a hang or Ctrl-C."""

    def __init__(
        self, cfg: LaunchConfig, proc: subprocess.Popen, listener: Listener | None = None
    ) -> None:
        self.cfg = cfg
        self.listener = listener
        self.heard: dict[int, progress.RankLine] = {}  # the latest line each rank sent
        self.storage_failed: list[dict] = []  # run.json ``storage_failed``
        self.checkpoints_missing: dict[int, list[str]] = {}  # steps done -> "rank N: error"
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
                    self.listen()
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
        except (KeyboardInterrupt, Terminated):
            log.error("interrupted: stopping the ranks")
            self.teardown()
            return "failed", 130

    def listen(self) -> None:
        """Take what the ranks sent: progress lines, writers' failures, missing checkpoints."""
        if self.listener is None:
            return
        for msg in self.listener.drain():
            rank = msg["rank"]
            if isinstance(msg.get("line"), str):
                try:
                    pid, step, ns, state = msg["line"].split()
                    line = progress.RankLine(int(pid), int(step), int(ns), state, msg["line"])
                except ValueError:
                    continue
                if rank not in self.heard or line.ns >= self.heard[rank].ns:
                    self.heard[rank] = line
            elif isinstance(msg.get("storage_failed"), dict):
                failure = msg["storage_failed"]
                if failure not in self.storage_failed:
                    self.storage_failed.append(failure)
                    log.warning(
                        "storage_failed: rank %s's %s writer: %s (%s), from step %s",
                        rank,
                        failure.get("writer"),
                        failure.get("path"),
                        failure.get("error"),
                        failure.get("step"),
                    )
            elif isinstance(msg.get("checkpoint_missing"), int):
                entry = f"rank {rank}: {msg.get('error')}"
                self.checkpoints_missing.setdefault(msg["checkpoint_missing"], []).append(entry)

    def lines(self) -> dict[int, progress.RankLine]:
        """Each rank's newest progress line: its file's, or the one it sent, whichever is newer."""
        self.listen()
        lines = progress.read_ranks(self.run_dir)
        for rank, line in self.heard.items():
            if rank not in lines or line.ns >= lines[rank].ns:
                lines[rank] = line
        return lines

    def _stalled(self) -> list[int]:
        """Ranks whose progress line has not changed for longer than they are allowed."""
        now = time.monotonic()
        lines = self.lines()
        mine = local_ranks(self.cfg)  # other nodes' pids are other hosts' processes
        for rank, line in lines.items():
            if rank in mine and self.seen.get(rank, ("", 0.0))[0] != line.raw:
                self.seen[rank] = (line.raw, now)
                self.pids[rank] = line.pid
        stalled = []
        for rank in mine:
            raw, since = self.seen.get(rank, ("", self.started))
            state = lines[rank].state if rank in lines else "absent"
            allowed = self.cfg.run.hang_timeout
            # importing torch, joining and building the model (and compiling during the
            # first step) may take longer than a step: a grace while ranks start up
            if state in ("absent", "start") or (state == "ready" and self.cfg.train.compiles):
                allowed = max(allowed, STARTUP_GRACE_S)
            if now - since > allowed:
                stalled.append(rank)
        return stalled

    def _end_hang(self, stalled: list[int]) -> None:
        steps = {r: self.lines().get(r) for r in stalled}
        log.error(
            "hang: no progress from ranks %s for %.0f s (last steps %s); taking stacks",
            stalled,
            self.cfg.run.hang_timeout,
            {r: (s.step if s else None) for r, s in steps.items()},
        )
        if self.cfg.run.trace:
            time.sleep(TRACER_STACK_WAIT_S)
        for rank, pid in sorted(self.pids.items()):
            try:
                if not progress.has_own_stack(self.run_dir, rank):
                    progress.dump_to_run(self.run_dir, rank, pid, reason="hang")
            except OSError as e:  # the run directory failed: the stacks are lost, not the run
                log.error("rank %d's stacks not written: %s", rank, e)
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
