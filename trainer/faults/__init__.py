"""Making the faults of docs/spec.md §5 real on the rank they name.

The fault language itself (parsing, validation) lives in :mod:`tracer.faults`; this module
turns a parsed :class:`~tracer.faults.Fault` into behaviour of a running rank:

* ``slow_rank`` — the rank's compute takes ``factor`` times as long. Inside every compute span
  the work runs and its own time ``t`` is measured: the span's elapsed time (after a device
  synchronize on CUDA) minus the time the rank spent blocked in collectives issued inside the
  span (a forward span with tensor-parallel collectives also holds the waits for the peers,
  which a slower GPU would not lengthen). The rank then sleeps ``(factor - 1) * t`` *inside*
  the span, so its time outside collectives becomes ``factor * t``: what the straggler
  detector measures.
* ``hang`` — at its first compute span of step ``S`` the rank blocks for good (a sleep loop), so
  it never enters its next collective and its peers sit waiting in theirs.
* ``crash`` — at its first compute span of step ``S`` the rank exits at once (``os._exit(1)``):
  no clean-up, no flush, as when a process is killed.
* ``pause`` — every ``every`` steps the rank stalls ``ms`` milliseconds outside any compute
  span, at the start of the step (like a garbage-collection pause).
* ``slow_data`` — loading this rank's batch takes ``ms`` milliseconds longer, inside the data
  span.
* ``slow_ckpt`` — every checkpoint persist on every rank takes ``ms`` milliseconds longer (a
  slow disk): :meth:`RankFaults.slow_disk` sleeps inside the write, on the thread that writes.
* ``slow_offload`` — every optimizer-offload transfer of the rank (``--optimizer-offload``:
  a gradient going down, a parameter coming back) takes ``ms`` milliseconds longer: a sleep
  inside the copy, on the offload thread (on a GPU, before the copy is queued).
* ``seq_skew`` — the data-parallel replica of the rank (every rank with its dp index: all
  its pipeline stages, TP and CP ranks) loads ``round(factor * micro_batch_size)`` rows per
  microbatch (at least one more than the others when ``factor > 1``), of the data as it comes:
  it really computes more, its pipeline transfers are larger, and the gradient reduction,
  whose shapes are the parameters', is unchanged. :func:`replica_rows` gives every replica's
  rows from the faults alone, so every rank knows them without a collective; the loop passes
  the engine its replica's loss weight, its rows over the mean rows, so that the loss and the
  gradients stay the mean over every token of the global batch (the one-process run on the
  replicas' batches side by side).
* ``slow_link`` — see :class:`LinkFaults`: the *transfer phase* of every operation over the
  link (from the last member's arrival to its end, what the slow-link detector measures) lasts
  ``factor`` times as long as the same operation's on the comparable healthy links; arrival
  times untouched.

Compute and data faults are applied by :class:`RankFaults`, which the per-rank loop consults
from its hooks. :class:`LinkFaults` wraps functions of ``torch.distributed`` once, *before* the
tracer attaches, so the tracer's timing of a collective includes the injected delay; the same
wrappers keep :data:`COMM_CLOCK`, the time blocked in communication that ``slow_rank`` leaves
out of the compute it stretches.
"""

from trainer.faults.clock import COMM_CLOCK, CommClock, sleep_until
from trainer.faults.links import LinkFaults
from trainer.faults.rank import RankFaults, replica_rows

__all__ = ["COMM_CLOCK", "CommClock", "LinkFaults", "RankFaults", "replica_rows", "sleep_until"]
