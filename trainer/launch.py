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
import subprocess
import sys
from typing import Any

from tracer.beacon import ENV as BEACON_ENV
from tracer.beacon import Listener
from tracer.cliutil import UsageError, fail
from tracer.loopback import free_port
from tracer.rundir import (
    base_run_json,
    mesh_groups,
    now_iso,
    read_run_json,
    reserve_status,
    write_json_atomic,
    write_reserved,
)
from trainer import lifeline, progress
from trainer.cliconfig import LaunchConfig, resolve
from trainer.nodes import (
    check_unclaimed,
    claim_node,
    combined_status,
    end_node,
    gather_nodes,
    launch_path,
    local_ranks,
    node_entry,
)
from trainer.supervisor import Supervisor, raise_terminated

log = logging.getLogger("megascope.train")


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
    reserve_status(out)
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
    listener = Listener()  # the ranks' progress and storage faults (tracer/beacon.py)
    env[BEACON_ENV] = listener.address
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        # its own session (a Ctrl-C reaches the launcher alone); torchrun and the ranks die
        # with the launcher all the same (trainer/lifeline.py)
        proc = subprocess.Popen(
            cmd, env=env, start_new_session=True, preexec_fn=lifeline.child_setup()
        )
        supervisor = Supervisor(cfg, proc, listener)
        status, code = supervisor.watch()
    finally:
        signal.signal(signal.SIGTERM, previous)
        listener.close()
    storage = storage_record(supervisor)
    if cfg.run.trace:
        _compact_leftovers(cfg)
    try:
        end_node(cfg, status, code)
    except OSError as e:
        log.error("node %d's outcome not written: %s", cfg.run.node_rank, e)
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
    try:
        meta = read_run_json(cfg.run.out)
    except ValueError as e:
        return _unwritten(cfg, status, code, storage, e)
    if cfg.run.nnodes > 1:
        meta["nodes"] = [node_entry(n) for n in nodes]
    meta.update(progress.read_model_report(cfg.run.out, meta))
    memory = progress.read_memory(cfg.run.out)
    if memory:
        meta["memory"] = memory
    meta["status"] = status
    meta["ended_at"] = now_iso()
    meta["summary"] = progress.summarize(cfg, progress.read_steps(cfg.run.out), meta)
    meta["summary"]["ranks_reporting"] = len(progress.read_ranks(cfg.run.out))
    meta.update(storage)
    try:
        write_json_atomic(os.path.join(cfg.run.out, "run.json"), meta)
    except OSError as e:
        return _unwritten(cfg, status, code, storage, e)
    log.info("run %s %s: %s", meta["run_id"], status, json.dumps(meta["summary"]))
    return code


def storage_record(supervisor: Supervisor) -> dict[str, Any]:
    """run.json's ``storage_failed`` (each writer of each rank that turned itself off: rank,
    writer, path, error, step) and ``checkpoints_missing`` (steps done -> the ranks' errors),
    from what the ranks sent; ``{}`` when nothing failed."""
    out: dict[str, Any] = {}
    if supervisor.storage_failed:
        out["storage_failed"] = sorted(
            supervisor.storage_failed, key=lambda f: (f.get("rank", 0), str(f.get("writer")))
        )
    if supervisor.checkpoints_missing:
        out["checkpoints_missing"] = {
            str(k): v for k, v in sorted(supervisor.checkpoints_missing.items())
        }
    return out


def _unwritten(
    cfg: LaunchConfig, status: str, code: int, storage: dict[str, Any], error: Exception
) -> int:
    """run.json could not be read or written (its disk failed): one line, the outcome in the
    reserved record (``.storage.json``, written in place) where it can go, and the
    training's own exit status."""
    record = {"status": status, "ended_at": now_iso(), **storage}
    kept = write_reserved(cfg.run.out, record)
    log.error(
        "run.json not updated (%s); the run %s%s%s",
        str(error).splitlines()[0] if str(error) else error.__class__.__name__,
        status,
        f", storage_failed: {json.dumps(storage.get('storage_failed'))}" if storage else "",
        "; recorded in .storage.json" if kept else "",
    )
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
