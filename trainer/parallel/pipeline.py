"""Pipeline parallelism: the stage split, point-to-point transfers and the 1F1B schedule.

The communication (:class:`P2P`) is kept apart from the schedule (:func:`one_f_one_b`): the
schedule only says *when* to send or receive, through the six calls of ``P2P``, and *when* to
run a microbatch's forward or backward, through two callbacks supplied by the engine.

1F1B (PipeDream-Flush, as in Megatron): stage ``s`` of ``S`` first runs ``S - s - 1`` warm-up
forwards, then alternates one forward and one backward (the steady state), then drains the
remaining backwards (cool-down). At most ``S - s`` microbatches' activations are alive on a
stage at once, against all of them with GPipe's all-forward-then-all-backward. Backwards run
in microbatch order 0, 1, ..., so the last backward on every stage is microbatch ``M - 1``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from trainer.parallel.mesh import Mesh

ForwardFn = Callable[[int, "torch.Tensor | None"], torch.Tensor]
BackwardFn = Callable[
    [int, "torch.Tensor | None", torch.Tensor, "torch.Tensor | None"], "torch.Tensor | None"
]


def stage_layers(n_layer: int, pp: int, stage: int) -> list[int]:
    """The block indices of ``stage``: contiguous, as even as possible, earlier stages
    taking one extra when ``pp`` does not divide ``n_layer``."""
    base, extra = divmod(n_layer, pp)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (1 if stage < extra else 0)))


class P2P:
    """Activation and gradient transfers between neighbouring stages of one pipeline.

    Every transfer is one ``dist.batch_isend_irecv`` of ``dist.P2POp``s, waited on at once;
    combined send+receive pairs (``send_forward_recv_backward`` and its mirror) post both
    operations in one batch so that two neighbours exchanging at the same time cannot
    deadlock. Activations travel as float32 tensors of a fixed ``shape`` per step, taken from
    the batch: every stage of a pipeline belongs to one data-parallel replica and loads the same
    batch, so the stages agree on it even when replicas differ in rows (``seq_skew``). Calls
    that have no peer (a receive on the first stage, a send on the last) do nothing and return
    None."""

    def __init__(self, mesh: Mesh, shape: tuple[int, ...], device: torch.device) -> None:
        self.group = mesh.groups.get("pp")
        self.stage, self.n_stages = mesh.index("pp"), mesh.size("pp")
        self.prev = mesh.pp_peer(-1) if self.stage > 0 else None
        self.next = mesh.pp_peer(+1) if self.stage < self.n_stages - 1 else None
        self.shape, self.device = shape, device

    def _exchange(
        self, send: tuple[torch.Tensor, int | None] | None, recv_from: int | None
    ) -> torch.Tensor | None:
        ops, buf = [], None
        if send is not None and send[1] is not None:
            t = send[0].detach().float().contiguous()
            ops.append(dist.P2POp(dist.isend, t, send[1], self.group))
        if recv_from is not None:
            buf = torch.empty(self.shape, dtype=torch.float32, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buf, recv_from, self.group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return buf

    def recv_forward(self) -> torch.Tensor | None:
        """The previous stage's activations (None on the first stage)."""
        return self._exchange(None, self.prev)

    def send_forward(self, y: torch.Tensor) -> None:
        """Send activations to the next stage."""
        self._exchange((y, self.next), None)

    def recv_backward(self) -> torch.Tensor | None:
        """The next stage's gradient (None on the last stage)."""
        return self._exchange(None, self.next)

    def send_backward(self, dx: torch.Tensor | None) -> None:
        """Send a gradient to the previous stage (nothing when ``dx`` is None)."""
        if dx is not None:
            self._exchange((dx, self.prev), None)

    def send_forward_recv_backward(self, y: torch.Tensor) -> torch.Tensor | None:
        """Send activations to the next stage and receive its gradient, in one batch."""
        return self._exchange((y, self.next), self.next)

    def send_backward_recv_forward(self, dx: torch.Tensor | None) -> torch.Tensor | None:
        """Send a gradient to the previous stage and receive its next activations, in one batch."""
        return self._exchange(None if dx is None else (dx, self.prev), self.prev)


def one_f_one_b(n_micro: int, p2p: P2P, forward: ForwardFn, backward: BackwardFn) -> None:
    """Run ``n_micro`` microbatches through this stage in 1F1B order.

    ``forward(mb, x)`` gets the received activation (None on the first stage) and returns this
    stage's output (the loss on the last stage). ``backward(mb, x, y, dy)`` gets the input and
    output of that forward and the gradient received from the next stage (None on the last
    stage) and returns the gradient of ``x`` to send back (None on the first stage).
    """
    warmup = min(p2p.n_stages - p2p.stage - 1, n_micro)
    steady = n_micro - warmup
    alive: deque[tuple[torch.Tensor | None, torch.Tensor]] = deque()

    def fwd(mb: int, x: torch.Tensor | None) -> torch.Tensor:
        y = forward(mb, x)
        alive.append((x, y))
        return y

    def bwd(mb: int, dy: torch.Tensor | None) -> torch.Tensor | None:
        x, y = alive.popleft()
        return backward(mb, x, y, dy)

    for mb in range(warmup):
        x = p2p.recv_forward()
        p2p.send_forward(fwd(mb, x))
    x = p2p.recv_forward() if steady else None
    for i in range(steady):
        dy = p2p.send_forward_recv_backward(fwd(warmup + i, x))
        dx = bwd(i, dy)
        if i == steady - 1:
            p2p.send_backward(dx)
        else:
            x = p2p.send_backward_recv_forward(dx)
    for mb in range(steady, n_micro):
        dy = p2p.recv_backward()
        p2p.send_backward(bwd(mb, dy))
