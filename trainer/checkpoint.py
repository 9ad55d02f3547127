"""Sharded checkpoints in two stages, and finding the latest complete one.

Layout: ``RUN/checkpoints/step-NNNNNN/rank-RRRRR.pt`` (``NNNNNN`` = steps done) plus a
``complete`` marker once every rank's shard is there.

Saving follows MegaScale's two-stage idea: the training thread only makes a quick copy of the
rank's state to CPU memory (a clone on CPU, a device-to-host copy on CUDA), then a background
thread serializes that copy to ``.rank-RRRRR.pt.tmp`` and renames it into place, so a shard
appears only complete and training continues during the write. After its rename each writer
looks for all ``world_size`` shards; the last one to arrive necessarily sees them all (every
other rename happened before its own) and writes the ``complete`` marker. At most one write per
rank is in flight: a new save first waits for the previous one.

A checkpoint holds the engine's shard (parameters, optimizer state, step) and the RNG states
of the process, so a resumed run continues bit for bit: the data of step ``n`` is a pure
function of the seed and ``n`` (see :func:`trainer.data.get_batch`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import threading
from typing import Any

import torch

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d{6,})$")


def checkpoints_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def step_dir(run_dir: str, steps_done: int) -> str:
    return os.path.join(checkpoints_dir(run_dir), f"step-{steps_done:06d}")


def shard_path(run_dir: str, steps_done: int, rank: int) -> str:
    return os.path.join(step_dir(run_dir, steps_done), f"rank-{rank:05d}.pt")


def latest_complete(run_dir: str, world_size: int) -> int | None:
    """Steps done at the newest checkpoint whose marker names ``world_size`` ranks, or None."""
    best = None
    try:
        names = os.listdir(checkpoints_dir(run_dir))
    except FileNotFoundError:
        return None
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
        if marker.get("world_size") == world_size:
            best = max(best or 0, int(m.group(1)))
    return best


def snapshot(obj: Any) -> Any:
    """A deep copy of a state dict with every tensor copied to CPU memory (stage one)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    return obj


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Checkpointer:
    """Saves this rank's shard every ``every`` steps (0: never) in the background."""

    def __init__(self, run_dir: str, rank: int, world_size: int, every: int) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.world_size = world_size
        self.every = every
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def due(self, steps_done: int) -> bool:
        return self.every > 0 and steps_done % self.every == 0

    def save(self, steps_done: int, engine_state: dict[str, Any]) -> None:
        """Copy the state to CPU now, write it in a background thread."""
        self.wait()
        state = {
            "steps_done": steps_done,
            "rank": self.rank,
            "world_size": self.world_size,
            "engine": snapshot(engine_state),
            "rng": rng_state(),
        }
        self._thread = threading.Thread(
            target=self._write, args=(steps_done, state), name="checkpoint-writer", daemon=True
        )
        self._thread.start()

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"checkpoint write failed: {error}") from error

    def _write(self, steps_done: int, state: dict[str, Any]) -> None:
        try:
            directory = step_dir(self.run_dir, steps_done)
            os.makedirs(directory, exist_ok=True)
            final = shard_path(self.run_dir, steps_done, self.rank)
            tmp = os.path.join(directory, f".rank-{self.rank:05d}.pt.tmp")
            torch.save(state, tmp)
            os.replace(tmp, final)
            shards = [shard_path(self.run_dir, steps_done, r) for r in range(self.world_size)]
            if all(os.path.exists(p) for p in shards):
                marker = os.path.join(directory, "complete")
                tmp_marker = f"{marker}.{self.rank}.tmp"
                with open(tmp_marker, "w", encoding="utf-8") as f:
                    json.dump({"steps_done": steps_done, "world_size": self.world_size}, f)
                os.replace(tmp_marker, marker)
            log.info("checkpoint: step %d shard written", steps_done)
        except BaseException as e:  # reported by the next wait()
            self.error = e


def load(run_dir: str, steps_done: int, rank: int) -> dict[str, Any]:
    """This rank's shard of the checkpoint at ``steps_done`` (as :meth:`Checkpointer.save` wrote it)."""
    state = torch.load(
        shard_path(run_dir, steps_done, rank), map_location="cpu", weights_only=False
    )
    if state.get("rank") != rank:
        raise ValueError(f"checkpoint shard for rank {rank} holds rank {state.get('rank')}")
    return state
