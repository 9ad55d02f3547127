"""A note when a run's storage failed under it (docs/spec.md §1, ``storage_failed``): which
writers turned themselves off, and what is missing from which step. The findings stand on what
was written; a reader should know where it ends."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from analyzer.db import Run
from analyzer.findings.record import Note
from tracer.rundir import read_reserved

# the launcher's claim of node 0 (trainer/nodes.py): its host and pid
CLAIM = os.path.join(".progress", "node-00000.json")


def storage_record(run: Run) -> dict[str, Any]:
    """run.json's ``storage_failed`` and ``checkpoints_missing``, or where run.json could not
    be written, the reserved record's (``.storage.json``)."""
    meta = run.meta
    if meta.get("storage_failed") or meta.get("checkpoints_missing"):
        return meta
    return read_reserved(run.path)


def launcher_gone(run_dir: str) -> bool:
    """Whether the run's launcher (node 0's claim, ``.progress/node-00000.json``) is a process
    of this host that has ended: a run whose status still says "running" then ended without
    recording it (its run.json could not be written: a read-only disk keeps nothing). False
    while the launcher lives, where it ran on another host, or where there is no claim (a
    script under torchrun alone): such a run may still be training."""
    try:
        with open(os.path.join(run_dir, CLAIM), encoding="utf-8") as f:
            claim = json.load(f)
        if claim.get("host") != socket.gethostname():
            return False
        os.kill(int(claim["pid"]), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return False


def _extent(run: Run) -> dict[int, tuple[int, int]]:
    if not run.has_rows("heartbeats"):
        return {}
    df = run.query("findings/rank_extent")
    return {int(r.rank): (int(r.first_step), int(r.last_step)) for r in df.itertuples()}


def note(run: Run) -> Note | None:
    """The ``storage`` note: one line saying what is missing and from which step (None when
    the run's storage did not fail as far as its files tell)."""
    record = storage_record(run)
    failed = [f for f in record.get("storage_failed") or [] if isinstance(f, dict)]
    ckpts = record.get("checkpoints_missing") or {}
    steps = (run.meta.get("train") or {}).get("steps")
    unended = (
        run.meta.get("status") == "running" and not record.get("status") and launcher_gone(run.path)
    )
    if not failed and not ckpts and not (unended and isinstance(steps, int)):
        return None
    extent = _extent(run)
    end = int(steps) - 1 if isinstance(steps, int) else max((e[1] for e in extent.values()),
                                                              default=-1)  # fmt: skip
    cut: dict[int, int] = {}  # rank -> the first step it lacks
    for f in failed:
        rank = int(f.get("rank", -1))
        last = extent.get(rank, (0, int(f.get("step", -1))))[1]
        if f.get("writer") == "tracer" or last < end:
            cut[rank] = min(cut.get(rank, 1 << 62), last + 1)
    for rank in range(run.world_size):
        if rank in extent and extent[rank][1] < end:
            cut[rank] = min(cut.get(rank, 1 << 62), extent[rank][1] + 1)
        elif rank not in extent and extent:
            cut[rank] = 0
    if not failed and not ckpts and not cut:
        return None
    parts = [f"rank {r} from step {s}" for r, s in sorted(cut.items())]
    if ckpts:
        parts.append(
            "the checkpoints at steps " + ", ".join(str(k) for k in sorted(ckpts, key=int))
        )
    why = "; ".join(
        f"rank {f.get('rank')}'s {f.get('writer')} writer: {f.get('error')} on {f.get('path')}"
        for f in failed[:4]
    ) + (f" and {len(failed) - 4} more" if len(failed) > 4 else "")
    return {
        "kind": "storage",
        "ranks": sorted({int(f.get("rank", -1)) for f in failed} | set(cut)),
        "message": (
            f"{'storage failed' if failed or ckpts else 'the run has no recorded end'}, missing: "
            f"{', '.join(parts) or 'nothing the ranks traced'}"
            + (
                f" ({why})"
                if why or ckpts
                else " (its launcher ended without writing run.json: its storage failed; "
                "its own log names the writer and the error)"
            )
        ),
        "evidence": {"storage_failed": failed, "checkpoints_missing": ckpts, "from_step": cut},
    }
