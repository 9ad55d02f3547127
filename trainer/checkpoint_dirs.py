"""Where a run's checkpoints live and which of them are whole: ``RUN/checkpoints/step-NNNNNN/``
with one shard folder per rank and a ``complete`` marker written last (trainer.checkpoint writes
them); the latest complete one, whether a resume's mesh matches it, and discarding later ones."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from typing import Any

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d{6,})$")


def checkpoints_dir(run_dir: str) -> str:
    """``RUN/checkpoints``."""
    return os.path.join(run_dir, "checkpoints")


def step_dir(run_dir: str, steps_done: int) -> str:
    """The checkpoint after ``steps_done`` steps: ``RUN/checkpoints/step-NNNNNN``."""
    return os.path.join(checkpoints_dir(run_dir), f"step-{steps_done:06d}")


def shard_dir(run_dir: str, steps_done: int, rank: int) -> str:
    """One rank's shard of that checkpoint: ``step-NNNNNN/rank-RRRRR``."""
    return os.path.join(step_dir(run_dir, steps_done), f"rank-{rank:05d}")


def complete_markers(run_dir: str) -> dict[int, dict[str, Any]]:
    """Steps done -> the ``complete`` marker, for every complete checkpoint of the run."""
    try:
        names = os.listdir(checkpoints_dir(run_dir))
    except (FileNotFoundError, NotADirectoryError):
        return {}
    out = {}
    for name in names:
        m = _STEP_DIR.match(name)
        if not m:
            continue
        try:
            with open(
                os.path.join(checkpoints_dir(run_dir), name, "complete"), encoding="utf-8"
            ) as f:
                marker = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(marker, dict):
            out[int(m.group(1))] = marker
    return out


def latest_complete(run_dir: str, world_size: int | None = None) -> int | None:
    """Steps done at the newest complete checkpoint (whose marker names ``world_size`` ranks,
    when given), or None. ``latest`` names the same one unless a crash fell between the two
    writes; the scan is the truth, the pointer a convenience for people and tools."""
    found = [
        s
        for s, marker in complete_markers(run_dir).items()
        if world_size is None or marker.get("world_size") == world_size
    ]
    return max(found, default=None)


def mismatch(
    marker: dict[str, Any], *, world_size: int, mesh: dict[str, int], model: dict[str, Any]
) -> str | None:
    """What differs between a checkpoint's marker and this launch (one phrase), or None."""
    if marker.get("world_size") != world_size:
        return f"was saved by a world of {marker.get('world_size')}, this launch has {world_size}"
    saved_mesh = marker.get("mesh")
    if saved_mesh is not None and saved_mesh != mesh:
        return f"was saved with mesh {_axes(saved_mesh)}, this launch has {_axes(mesh)}"
    saved_model = marker.get("model")
    if saved_model is not None:
        keys = sorted(set(saved_model) | set(model))
        diff = [k for k in keys if saved_model.get(k) != model.get(k)]
        if diff:
            saved = ", ".join(f"{k}={saved_model.get(k)}" for k in diff[:4])
            mine = ", ".join(f"{k}={model.get(k)}" for k in diff[:4])
            return f"was saved from another model ({saved}; this launch: {mine})"
    return None


def _axes(mesh: dict[str, Any]) -> str:
    return " ".join(f"{k}{v}" for k, v in mesh.items())


def discard_after(run_dir: str, steps_done: int) -> list[str]:
    """Remove the step folders after ``steps_done`` (incomplete ones a crash left; a resume
    from ``steps_done`` writes them again); returns their names."""
    root = checkpoints_dir(run_dir)
    gone = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        m = _STEP_DIR.match(name)
        if m and int(m.group(1)) > steps_done:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            gone.append(name)
    return gone
