"""Spawn real gloo process groups for tests.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes, initialises a gloo group
in each (env:// on a free loopback port), calls ``fn(rank, world_size, *args)`` and returns the
list of the ranks' return values (they must pickle). A failure in any rank fails the call with
that rank's traceback. ``fn`` must be a module-level function.

The ranks are forked from a fork server that imported torch once for the session (most of a
spawned rank's start: 2-9 s each where 8 import at once on 2 cores), and that never computed, so
that no thread pool is forked. Each rank takes the caller's environment and working directory
as they are at the call, as a spawned one would.

Tests take it through the ``ranks`` fixture (tests/conftest.py), which marks them ``live``.
"""

from __future__ import annotations

import gc
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from helpers.net import LOOPBACK, free_port

# imported once by the fork server: what every rank imports
PRELOAD = ["torch", "torch.distributed", "torch.nn", "numpy", "helpers.ranks"]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable,
    args: tuple,
    queue,
    env: dict[str, str],
    cwd: str,
) -> None:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR=LOOPBACK,
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        gc.collect()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0) -> list[Any]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    queue = ctx.SimpleQueue()
    port = free_port()
    env, cwd = dict(os.environ), os.getcwd()
    procs = [
        ctx.Process(
            target=_worker, args=(r, world_size, port, fn, args, queue, env, cwd), daemon=False
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import time

    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size:
        if time.monotonic() > deadline:
            break
        if queue.empty():
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
            time.sleep(0.05)
            continue
        rank, ok, value = queue.get()
        if ok:
            results[rank] = value
        else:
            errors.append(f"rank {rank}:\n{value}")
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    if len(results) != world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise AssertionError(
            f"ranks {missing} returned nothing (exit codes {[p.exitcode for p in procs]})"
        )
    return [results[r] for r in range(world_size)]
