"""A small mixture-of-experts-shaped job on real gloo process groups, for Flight Recorder sets.

``torchrun --nproc-per-node 8 tests/scripts/fr_ep_job.py`` (see ``tests/helpers/fr_cases.py``): ranks in the
SPEC order of a dp2 x pp2 x tp2 mesh, with groups described as Megatron describes them
(``TENSOR_MODEL_PARALLEL_GROUP``, ``PIPELINE_MODEL_PARALLEL_GROUP``, ``DATA_PARALLEL_GROUP``)
plus ``EXPERT_MODEL_PARALLEL_GROUP``: the four ranks of a pipeline stage, which exchange tokens
with ``all_to_all`` (dispatch and combine) around every tensor-parallel all-reduce. Each
iteration runs two microbatches forward through the two stages (activations sent stage 0 ->
1), then backward (gradients sent 1 -> 0), a data-parallel all-reduce and a loss all-reduce
over the pipeline.

``EP_FAULT=KIND:rank=R,iter=I`` acts on rank R just before its first expert all_to_all of
iteration I: ``hang`` (sleeps for good), ``gil`` (sleeps holding the GIL), ``kill`` (enters the
all_to_all, then SIGKILLs itself), ``stop`` (enters it, then SIGSTOPs itself). The faulty rank
writes ``EP_MARK`` (a path) first, so the caller knows when the fault fired.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

import torch
import torch.distributed as dist

DP, PP, TP = 2, 2, 2
ITERS = int(os.environ.get("EP_ITERS", "8"))


def rank_of(pp: int, dp: int, tp: int) -> int:
    return (pp * DP + dp) * TP + tp


def main() -> None:  # noqa: C901 -- a launched script's one straight scenario, phase after phase
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pp, rest = divmod(rank, DP * TP)
    dp, tp = divmod(rest, TP)
    mine = {}
    for p in range(PP):
        for d in range(DP):
            ranks = [rank_of(p, d, t) for t in range(TP)]
            g = dist.new_group(ranks, group_desc="TENSOR_MODEL_PARALLEL_GROUP")
            mine.setdefault("tp", g) if rank in ranks else None
    for p in range(PP):
        for t in range(TP):
            ranks = [rank_of(p, d, t) for d in range(DP)]
            g = dist.new_group(ranks, group_desc="DATA_PARALLEL_GROUP")
            mine.setdefault("dp", g) if rank in ranks else None
    for d in range(DP):
        for t in range(TP):
            ranks = [rank_of(p, d, t) for p in range(PP)]
            g = dist.new_group(ranks, group_desc="PIPELINE_MODEL_PARALLEL_GROUP")
            mine.setdefault("pp", g) if rank in ranks else None
    for p in range(PP):
        ranks = [rank_of(p, d, t) for d in range(DP) for t in range(TP)]
        g = dist.new_group(ranks, group_desc="EXPERT_MODEL_PARALLEL_GROUP")
        mine.setdefault("ep", g) if rank in ranks else None
    prev = rank_of(pp - 1, dp, tp) if pp > 0 else None
    nxt = rank_of(pp + 1, dp, tp) if pp < PP - 1 else None

    kind, target, at = "", -1, -1
    spec = os.environ.get("EP_FAULT", "")
    if spec:
        kind, _, rest_ = spec.partition(":")
        args = dict(kv.split("=") for kv in rest_.split(",") if kv)
        target, at = int(args["rank"]), int(args["iter"])

    def fault() -> None:
        mark = os.environ.get("EP_MARK")
        if mark:
            with open(mark, "w") as f:
                f.write(f"{rank} {kind}\n")
        time.sleep(0.3)  # let a dump or two go by
        if kind == "hang":
            while True:
                time.sleep(1.0)
        if kind == "gil":
            ctypes.PyDLL(None).sleep(100000)  # libc sleep with the GIL held

    x = torch.ones(256)
    tokens = torch.ones(4 * 64)
    for it in range(ITERS):
        for mb in range(2):
            if prev is not None:
                dist.recv(x, prev, group=mine["pp"])
            time.sleep(0.005)  # compute
            dist.all_reduce(x, group=mine["tp"])
            out = torch.empty_like(tokens)
            if rank == target and it == at and mb == 0:
                fault()
                if kind in ("kill", "stop"):
                    work = dist.all_to_all_single(out, tokens, group=mine["ep"], async_op=True)
                    time.sleep(0.3)
                    os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
                    work.wait()
            dist.all_to_all_single(out, tokens, group=mine["ep"])  # dispatch
            dist.all_reduce(x, group=mine["tp"])
            dist.all_to_all_single(tokens, out, group=mine["ep"])  # combine
            if nxt is not None:
                dist.send(x, nxt, group=mine["pp"])
        for _mb in range(2):
            if nxt is not None:
                dist.recv(x, nxt, group=mine["pp"])
            dist.all_reduce(x, group=mine["tp"])
            if prev is not None:
                dist.send(x, prev, group=mine["pp"])
        dist.all_reduce(x, group=mine["dp"])
        dist.all_reduce(x, group=mine["pp"])
        x.fill_(1.0)
        tokens.fill_(1.0)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
