"""Activation recompute: keep a block's (or its attention's) input, not its activations, and
run its forward again in the backward (``torch.utils.checkpoint``, non-reentrant).

``apply(stage, how, hooks, microbatch)``: ``full`` recomputes every transformer block of the
stage, ``selective`` only each block's attention (the part whose activations grow with the
sequence). Parameter names do not change (the modules' ``forward`` is wrapped in place), so
checkpoints and the gathered model read as without recompute. The forward run again inside the
backward is a ``recompute`` span, so what recompute costs shows on the timeline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.hooks import Hooks


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (the recompute pass)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _recomputed(module: nn.Module, hooks: Hooks, microbatch: Callable[[], int]) -> None:
    inner = module.forward

    def run(*args: Any) -> Any:
        if _in_backward():
            with hooks.span("recompute", "compute", microbatch()):
                return inner(*args)
        return inner(*args)

    def forward(*args: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args)
        return checkpoint(run, *args, use_reentrant=False)

    module.forward = forward


def apply(stage: nn.Module, how: str, hooks: Hooks, microbatch: Callable[[], int]) -> None:
    """Wrap the stage's blocks (``full``) or their attention (``selective``); ``none``: nothing."""
    if how == "none":
        return
    for block in stage.get_submodule("h").children():  # the stage's blocks, in order
        _recomputed(block if how == "full" else block.get_submodule("attn"), hooks, microbatch)
