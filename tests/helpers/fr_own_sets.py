"""Flight Recorder sets of ten fault kinds beyond ``tests/data``, each checked against its
injection: NCCL-shaped jobs (:mod:`nccl_fr`, copies of real entries), built at test time in
about a second each, whose truth is the faults their dumps can show (:mod:`fr_truth`).

Each set is one kind of failure: a rank that dies inside an expert all_to_all; two GPUs that
fail at once in different tensor, pipeline and data groups (the kind of the NVIDIA set,
``gpu_error_2nd``, where they shared a stage); a rank stuck with the GIL held; dumps missing
from ranks that were not at fault; ring buffers that wrapped; two GPUs failing in one expert
all_to_all; a GPU dying in a pipeline send; a rank hung before the data-parallel all-reduce; a
rank killed inside a ``batch_isend_irecv``; a GPU error and a hung CPU at once in groups known
by number only.

``PYTHONPATH=tests python -m helpers.fr_own_sets OUT [NAME...]`` writes them under ``OUT/NAME``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from helpers import fr_truth, nccl_fr
from helpers.nccl_fr import Fault, Job


@dataclass(frozen=True)
class OwnSet:
    job: Job
    kind: str  # the fault kind, one per set
    drop: tuple[int, ...] = ()  # ranks whose dump is lost (not culprits)


SETS = {
    s.job.name: s
    for s in [
        OwnSet(Job("own_ep_a2a_death", dp=2, pp=2, tp=2,
                   faults=(Fault("killed", 5, 1, "ep", 0),), only_active=False,
                   what="rank 5 dies inside an expert all_to_all; its stage waits in it"),
               "rank dies in an expert-parallel all_to_all"),
        OwnSet(Job("own_two_gpus_two_groups", dp=2, pp=2, tp=4,
                   faults=(Fault("dead_gpu", 3, 1, "tp", 3), Fault("dead_gpu", 12, 1, "tp", 3)),
                   what="GPUs of ranks 3 and 12 fail at once: other stage, tp and dp groups"),
               "two GPUs lost in different groups"),
        OwnSet(Job("own_gil_held", dp=2, pp=2, tp=2, timing=True, fmt="json",
                   faults=(Fault("cpu_stop", 6, 1, "tp", 2),),
                   what="rank 6 stops enqueueing (a thread holds the GIL) before a tp collective"),
               "rank stuck with the GIL held"),
        OwnSet(Job("own_missing_dumps", dp=2, pp=2, tp=2,
                   faults=(Fault("dead_gpu", 1, 1, "tp", 1),),
                   what="rank 1's GPU fails; the dumps of ranks 4 and 7 are lost"),
               "dumps missing from some ranks", drop=(4, 7)),
        OwnSet(Job("own_wrapped_buffers", dp=2, pp=2, tp=2, only_active=False, buffer=24,
                   iterations=4, timing=True,
                   faults=(Fault("dead_gpu", 2, 2, "tp", 4),),
                   what="rank 2's GPU fails; whole ring buffers of 24 entries, wrapped"),
               "wrapped ring buffers"),
        OwnSet(Job("own_two_gpus_one_a2a", dp=2, pp=2, tp=2, timing=True,
                   faults=(Fault("dead_gpu", 4, 1, "ep", 1), Fault("dead_gpu", 7, 1, "ep", 1)),
                   what="GPUs of ranks 4 and 7 fail in the same expert all_to_all"),
               "two GPUs lost in one expert all_to_all"),
        OwnSet(Job("own_gpu_dies_in_send", dp=1, pp=4, tp=2, ep=False, timing=True,
                   faults=(Fault("dead_gpu", 3, 1, "send", 1),),
                   what="rank 3's GPU fails inside a pipeline send"),
               "GPU dies in a pipeline send"),
        OwnSet(Job("own_hang_before_dp", dp=4, pp=2, tp=1, ep=False,
                   faults=(Fault("cpu_stop", 2, 1, "dp", 0),),
                   what="rank 2 hangs before the data-parallel all-reduce"),
               "rank hangs before the gradient all-reduce"),
        OwnSet(Job("own_killed_in_batch", dp=2, pp=2, tp=2, p2p_on_default=True, fmt="json",
                   faults=(Fault("killed", 6, 1, "batch", 1),),
                   what="rank 6 is killed inside a batch_isend_irecv on the default group"),
               "rank killed in a batched send/recv"),
        OwnSet(Job("own_gpu_and_cpu_by_number", dp=2, pp=2, tp=2, named=False,
                   faults=(Fault("dead_gpu", 0, 1, "tp", 2), Fault("cpu_stop", 7, 1, "ep", 2)),
                   what="rank 0's GPU fails and rank 7's CPU hangs; groups named by number"),
               "a GPU error and a hung CPU at once, groups known by number only"),
    ]
}  # fmt: skip


def write(own: OwnSet, out: str) -> list[int]:
    """Write ``own``'s dumps and ``fault_injection.log`` to ``out``; return the culprits."""
    truth = fr_truth.write(own.job, out)
    for name in os.listdir(out):
        digits = "".join(c for c in name.split(".")[0] if c.isdigit())
        if digits and int(digits) in own.drop:
            os.remove(os.path.join(out, name))
    with open(os.path.join(out, "fault_injection.log"), "a") as f:
        f.write(f"Kind: {own.kind}" + (f"; dumps removed: {list(own.drop)}" if own.drop else ""))
        f.write("\n")
    return truth


if __name__ == "__main__":
    root = sys.argv[1]
    for name in sys.argv[2:] or list(SETS):
        print(name, write(SETS[name], os.path.join(root, name)), nccl_fr.JOBS.get(name))
