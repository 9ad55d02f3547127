"""One run over several nodes (docs/tracer.md): each launch claims its node in
``RUN/.progress/node-KKKKK.json``, created exclusively, and leaves its outcome there; node 0
gathers the nodes' outcomes into one status. Paths of the launcher's hidden files."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any

from tracer.cliutil import UsageError
from tracer.rundir import combined_status as rundir_combined
from tracer.rundir import now_iso, write_json_atomic
from trainer import progress
from trainer.cliconfig import LaunchConfig

log = logging.getLogger("megascope.train")

POLL_S = 0.2
NODE_WAIT_S = 60.0  # node 0 waits this long for the outcome of the other nodes it can see


def node_path(run_dir: str, node: int) -> str:
    """The claim (and, at the end, the outcome) of one node's launch."""
    return os.path.join(progress.progress_dir(run_dir), f"node-{node:05d}.json")


def launch_path(run_dir: str, node: int) -> str:
    """The configuration one node's launcher hands its ranks (node 0: ``launch.json``)."""
    name = "launch.json" if node == 0 else f"launch-node-{node:05d}.json"
    return os.path.join(progress.progress_dir(run_dir), name)


def local_ranks(cfg: LaunchConfig) -> range:
    """The global ranks this node's launch runs."""
    local = cfg.world_size // cfg.run.nnodes
    return range(cfg.run.node_rank * local, (cfg.run.node_rank + 1) * local)


def read_node(run_dir: str, node: int) -> dict[str, Any] | None:
    """One node's claim (or outcome), None when it is missing or unreadable."""
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


def node_entry(claim: dict[str, Any]) -> dict[str, Any]:
    """A node's claim as run.json's ``nodes`` lists it."""
    keys = ("node", "host", "ranks", "status", "exit_code", "started_at", "ended_at")
    return {k: claim.get(k) for k in keys}
