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

A run over several nodes (``--nnodes N --node-rank K --rdzv-endpoint HOST:PORT``, one launch per
node, the run directory on storage every node sees) is still one run (docs/tracer.md):

* each launch claims its node in ``RUN/.progress/node-KKKKK.json``, created exclusively, so a
  second launch of the same node (or a single-node launch onto a run in progress) is refused in
  one line; a later node checks that run.json, when node 0 has written it, is this launch's;
* node 0's launcher alone writes run.json; a node K > 0 hands its ranks their configuration in
  ``.progress/launch-node-KKKKK.json`` and, at the end, its outcome in its claim file;
* every launcher watches, stacks and tears down its own ranks only (pids are per host);
* node 0, once its ranks are done, waits (up to ``NODE_WAIT_S``) for the outcome of every node
  whose claim it sees, and writes one status for all: ``hung`` if a node saw a hang, else
  ``failed`` if one failed, else ``finished``; ``nodes`` lists each node's own.

With a run directory per node (local disks), ``megascope gather`` merges the nodes' folders
into one run afterwards (analyzer/commands/gather.py).
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
from tracer.rundir import combined_status as rundir_combined
from trainer import lifeline, progress
from trainer.cliconfig import LaunchConfig, resolve

log = logging.getLogger("megascope.train")

STARTUP_GRACE_S = 300.0  # silence allowed while a rank imports torch, joins and builds its model
TRACER_STACK_WAIT_S = 2.0  # the tracer's watchdog takes its own stack at the same timeout
TERM_GRACE_S = 3.0  # SIGTERM to SIGKILL
POLL_S = 0.2
NODE_WAIT_S = 60.0  # node 0 waits this long for the outcome of the other nodes it can see


class _Terminated(Exception):
    """The launcher itself got SIGTERM: tear down like Ctrl-C."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_path(run_dir: str, node: int) -> str:
    """The claim (and, at the end, the outcome) of one node's launch."""
    return os.path.join(progress.progress_dir(run_dir), f"node-{node:05d}.json")


def launch_path(run_dir: str, node: int) -> str:
    """The configuration one node's launcher hands its ranks (node 0: ``launch.json``)."""
    name = "launch.json" if node == 0 else f"launch-node-{node:05d}.json"
    return os.path.join(progress.progress_dir(run_dir), name)


def local_ranks(cfg: LaunchConfig) -> range:
    local = cfg.world_size // cfg.run.nnodes
    return range(cfg.run.node_rank * local, (cfg.run.node_rank + 1) * local)


def read_node(run_dir: str, node: int) -> dict[str, Any] | None:
    try:
        with open(node_path(run_dir, node), encoding="utf-8") as f:
            obj = json.load(f)
        return obj if isinstance(obj, dict) else None
    except (OSError, ValueError):
        return None


def claim_node(cfg: LaunchConfig, run_id: str | None) -> dict[str, Any]:
    """Claim this launch's node of the run directory (exclusive create); UsageError when
    another launch holds it. A claim whose launch ended is replaced on ``--resume``."""
    out, node = cfg.run.out, cfg.run.node_rank
    ranks = local_ranks(cfg)
    claim = {
        "node": node,
        "nnodes": cfg.run.nnodes,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "ranks": [ranks.start, ranks.stop - 1],
        "world_size": cfg.world_size,
        "mesh": cfg.parallel.sizes,
        "rdzv_endpoint": cfg.run.rdzv_endpoint,
        "run_id": run_id,
        "status": "running",
        "exit_code": None,
        "started_at": now_iso(),
        "ended_at": None,
    }
    path = node_path(out, node)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        check_unclaimed(cfg)
        if not cfg.run.resume:
            raise UsageError(
                f"{out} already holds a run (pass --resume, or choose another --out)"
            ) from None
        write_json_atomic(path, claim)
        return claim
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(claim, f, indent=2)
    return claim


def check_unclaimed(cfg: LaunchConfig) -> None:
    """UsageError when a launch of this node of this run directory is under way."""
    out, node = cfg.run.out, cfg.run.node_rank
    old = read_node(out, node) or {}
    if old.get("status") == "running":
        raise UsageError(
            f"{out}: node {node} of this run is already launched (host {old.get('host')}, "
            f"pid {old.get('pid')}, since {old.get('started_at')}); check --out and "
            f"--node-rank, or remove {node_path(out, node)} if that launcher is dead"
        )


def end_node(cfg: LaunchConfig, status: str, code: int) -> dict[str, Any]:
    """Record this node's outcome in its claim; returns it."""
    claim = read_node(cfg.run.out, cfg.run.node_rank) or {"node": cfg.run.node_rank}
    claim.update(status=status, exit_code=code, ended_at=now_iso())
    write_json_atomic(node_path(cfg.run.out, cfg.run.node_rank), claim)
    return claim


def gather_nodes(run_dir: str, nnodes: int, wait_s: float = NODE_WAIT_S) -> list[dict[str, Any]]:
    """Every node's claim (node 0's included), waiting up to ``wait_s`` for the ones seen
    running to end; a node never seen here (a run directory per node) is ``{"node": K}``."""
    deadline = time.monotonic() + wait_s
    while True:
        nodes = [read_node(run_dir, k) or {"node": k} for k in range(nnodes)]
        running = [n["node"] for n in nodes[1:] if n.get("status") == "running"]
        if not running or time.monotonic() > deadline:
            if running:
                log.error("nodes %s have not reported their end after %.0f s", running, wait_s)
            return nodes
        time.sleep(POLL_S)


def combined_status(nodes: list[dict[str, Any]]) -> str:
    """One status for the run from the nodes' own (:func:`tracer.rundir.combined_status`)."""
    return rundir_combined([n.get("status") for n in nodes])


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
        "--launch",
        os.path.abspath(launch_path(run.out, run.node_rank)),
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
    """Check the run directory, claim this node, write run.json (node 0) and the ranks'
    launch configuration; return run.json (on a node K > 0: what it will hold, unwritten)."""
    if cfg.run.node_rank > 0:
        return _prepare_node(cfg)
    check_unclaimed(cfg)
    out = cfg.run.out
    existing = os.path.exists(os.path.join(out, "run.json"))
    resumed_from, old = None, {}
    if cfg.run.resume:
        if not existing:
            raise UsageError(f"--resume: {out} holds no run to resume")
        old = read_run_json(out)
        resumed_from = _resume_point(cfg, old)
        if resumed_from >= min(cfg.train.steps, cfg.run.stop_after or cfg.train.steps):
            raise UsageError(f"--resume: {out} is already at step {resumed_from}; raise --steps")
    elif existing:
        raise UsageError(f"{out} already holds a run (pass --resume, or choose another --out)")
    os.makedirs(progress.progress_dir(out), exist_ok=True)
    meta = base_run_json(
        run_id=old.get("run_id") if cfg.run.resume else None,
        world_size=cfg.world_size,
        mesh=cfg.parallel.sizes,
        groups=mesh_groups(cfg.parallel.sizes) + _expert_groups(cfg),
        device=cfg.train.device,
        model={"config": cfg.to_mapping()["model"], "params": None, "flops_per_token": None},
        tracer=_tracer_settings(cfg),
        injections=cfg.run.injections,
        versions=_versions(),
    )
    meta["parallel"] = cfg.to_mapping()["parallel"]
    meta["train"] = cfg.to_mapping()["train"]
    meta["launch"] = {"nnodes": cfg.run.nnodes, "rdzv_endpoint": cfg.run.rdzv_endpoint}
    claim_node(cfg, meta["run_id"])  # after every check: a refused launch claims nothing
    progress.clear_ranks(out, local_ranks(cfg))
    if resumed_from is not None:  # the run keeps its identity and start; the launch is new
        meta["started_at"] = old.get("started_at", meta["started_at"])
        meta["resumed_at"] = now_iso()
        meta["resumed_from_step"] = resumed_from
    write_json_atomic(launch_path(out, 0), cfg.to_mapping())
    write_json_atomic(os.path.join(out, "run.json"), meta)
    return meta


def _expert_groups(cfg: LaunchConfig) -> list[dict[str, Any]]:
    """The ``ep`` and ``edp`` groups of an expert-parallel run (none otherwise), for run.json."""
    if cfg.parallel.ep == 1:
        return []
    from trainer.parallel.mesh import expert_groups

    return expert_groups(cfg.parallel)


def _resume_point(cfg: LaunchConfig, old: dict[str, Any]) -> int:
    """The steps done at the checkpoint a ``--resume`` starts from: the newest complete one,
    which must come from this mesh and model (one line naming the difference otherwise).
    The incomplete checkpoints after it (a crash during their write) are removed."""
    from trainer import checkpoint

    out, mesh = cfg.run.out, cfg.parallel.sizes
    if old.get("mesh") != mesh:
        raise UsageError(
            f"--resume: {out} was run with mesh {old.get('mesh')}, this launch has mesh {mesh}"
        )
    old_ep = (old.get("parallel") or {}).get("ep", 1)
    if old_ep != cfg.parallel.ep:
        raise UsageError(
            f"--resume: {out} was run with ep={old_ep}, this launch has ep={cfg.parallel.ep}"
        )
    markers = checkpoint.complete_markers(out)
    if not markers:
        raise UsageError(f"--resume: {out} has no complete checkpoint")
    steps = max(markers)
    problem = checkpoint.mismatch(markers[steps], world_size=cfg.world_size, mesh=mesh,
                                  model=cfg.to_mapping()["model"])  # fmt: skip
    if problem:
        raise UsageError(f"--resume: the checkpoint at step {steps} in {out} {problem}")
    checkpoint.discard_after(out, steps)
    return steps


def _prepare_node(cfg: LaunchConfig) -> dict[str, Any]:
    """A node K > 0: check what node 0 wrote, if it is visible yet, claim node K."""
    out, node = cfg.run.out, cfg.run.node_rank
    check_unclaimed(cfg)
    meta: dict[str, Any] = {}
    if os.path.exists(os.path.join(out, "run.json")):
        meta = read_run_json(out)
        launch = meta.get("launch") or {}
        if meta.get("status") != "running" and not cfg.run.resume:
            raise UsageError(f"{out} already holds a run (pass --resume, or choose another --out)")
        if meta.get("status") == "running" and (
            meta.get("world_size") != cfg.world_size
            or meta.get("mesh") != cfg.parallel.sizes
            or launch.get("nnodes") != cfg.run.nnodes
        ):
            raise UsageError(
                f"{out} holds another launch's run (world {meta.get('world_size')}, mesh "
                f"{meta.get('mesh')}, {launch.get('nnodes', 1)} nodes; this launch: world "
                f"{cfg.world_size}, mesh {cfg.parallel.sizes}, {cfg.run.nnodes} nodes); "
                "check --out"
            )
    claim_node(cfg, meta.get("run_id"))
    progress.clear_ranks(out, local_ranks(cfg))
    write_json_atomic(launch_path(out, node), cfg.to_mapping())
    return {"run_id": meta.get("run_id") or f"(node 0's, node {node})"}


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
        # its own session (a Ctrl-C reaches the launcher alone); torchrun and the ranks die
        # with the launcher all the same (trainer/lifeline.py)
        proc = subprocess.Popen(
            cmd, env=env, start_new_session=True, preexec_fn=lifeline.child_setup()
        )
        status, code = Supervisor(cfg, proc).watch()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if cfg.run.trace:
        _compact_leftovers(cfg)
    end_node(cfg, status, code)
    if cfg.run.node_rank > 0:  # run.json is node 0's: it reads this node's outcome
        log.info("node %d %s; node 0 writes the run's status", cfg.run.node_rank, status)
        return code
    if cfg.run.nnodes > 1:
        nodes = gather_nodes(cfg.run.out, cfg.run.nnodes)
        overall = combined_status(nodes)
        if overall != status:
            log.error("the run %s (nodes: %s)", overall,
                      {n["node"]: n.get("status") for n in nodes})  # fmt: skip
            if code == 0:
                code = 3 if overall == "hung" else 1
            status = overall
    meta = read_run_json(cfg.run.out)
    if cfg.run.nnodes > 1:
        meta["nodes"] = [_node_entry(n) for n in nodes]
    meta.update(progress.read_model_report(cfg.run.out, meta))
    meta["status"] = status
    meta["ended_at"] = now_iso()
    meta["summary"] = progress.summarize(cfg, progress.read_steps(cfg.run.out), meta)
    meta["summary"]["ranks_reporting"] = len(progress.read_ranks(cfg.run.out))
    write_json_atomic(os.path.join(cfg.run.out, "run.json"), meta)
    log.info("run %s %s: %s", meta["run_id"], status, json.dumps(meta["summary"]))
    return code


def _compact_leftovers(cfg: LaunchConfig) -> None:
    """Merge what ranks killed before their tracer's close left (one file per rank and table
    after a clean close; a crashed or torn-down rank may leave a few dozen small parts)."""
    from tracer.schema import TABLES
    from tracer.writer import PartWriter

    for rank in local_ranks(cfg):
        writer = PartWriter(cfg.run.out, rank)
        for table in TABLES:
            try:
                writer.compact(table, 2)
            except Exception as e:  # an unreadable part: leave the rank's files as they are
                log.warning("rank %d %s not compacted: %s", rank, table, str(e).splitlines()[0])


def _node_entry(claim: dict[str, Any]) -> dict[str, Any]:
    keys = ("node", "host", "ranks", "status", "exit_code", "started_at", "ended_at")
    return {k: claim.get(k) for k in keys}


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
