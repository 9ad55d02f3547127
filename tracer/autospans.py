"""Steps and spans for a script that calls no tracer function.

A user's script has a loop the tracer cannot see, but it can see what every training loop
calls. :class:`AutoSpans` installs, at attach:

* torch.optim's global optimizer-step hooks: the first optimizer that steps is the primary one;
  its ``step()`` is the ``optimizer`` span and ends the training step (other optimizers get
  spans of their own and do not end steps). A step given a closure that runs the forward and
  backward (Lightning's automatic optimization) has its span start after the closure's last
  forward or backward;
* forward hooks on the outermost module: the first module called at the top level (not from
  inside another module) that holds parameters (a DDP or FSDP root, or the plain model). Until
  it is found, global module hooks watch the nesting depth; then they are removed, so the
  search costs one call. Its n-th forward in a step is microbatch n;
* ``torch.autograd.backward`` (what ``Tensor.backward`` calls): the ``backward`` span, numbered
  like the forwards;
* the DataLoader iterator's ``__next__``: a ``data`` span, given to the step that the next
  forward, backward or optimizer step begins (so that a loop's last ``next``, which ends the
  epoch, begins no step). The step starts where its data loading started.

A step begins with the first of these in it and ends when the primary optimizer's step returns;
``step`` spans and heartbeats follow as with :func:`tracer.step`. An explicit
:func:`tracer.step` turns the automatic steps off, an explicit ``forward``, ``backward``,
``optimizer`` or ``data`` span the automatic spans: code that says what it does wins. On GPU the
compute spans are CUDA events, as with :func:`tracer.span`. Every hook is guarded: a failure
turns the tracer off (once, with a warning), never the training.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from tracer.spans import Span

if TYPE_CHECKING:
    from tracer.core import Tracer

AUTO_SPAN_NAMES = frozenset({"forward", "backward", "optimizer", "data"})


class AutoSpans:
    """The automatic steps and spans of one attached tracer (see the module docstring)."""

    def __init__(self, tr: Tracer) -> None:
        self.tr = tr
        self.steps = True
        self.spans = True
        self._in_step = False
        self._next_step = 0
        self._counted_step: int | None = None
        self._fwd = 0
        self._bwd = 0
        self._primary: Any = None  # weakref to the primary optimizer
        self._root: Any = None  # weakref to the outermost module
        self._depth = 0
        self._fwd_stack: list[Any] = []
        self._opt_spans: dict[int, Any] = {}
        self._data: list[tuple[int, int]] = []  # data spans waiting for their step
        self._global: list[Any] = []
        self._root_hooks: list[Any] = []
        self._handles: list[Any] = []
        self._patched: list[tuple[Any, str, Any, Any]] = []  # owner, name, original, wrapper

    # -- installing -------------------------------------------------------------------------
    def install(self) -> None:
        """Put the hooks in place (the module docstring): torch.optim's global step hooks, the
        module hooks that find the outermost module, ``torch.autograd.backward`` and the DataLoader
        iterator's ``__next__``."""
        import torch
        import torch.nn.modules.module as mm
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        self._handles += [
            register_optimizer_step_pre_hook(self._guard(self._opt_pre)),
            register_optimizer_step_post_hook(self._guard(self._opt_post)),
        ]
        self._search_root(mm)
        self._patch(torch.autograd, "backward", self._backward)
        self._patch(_BaseDataLoaderIter, "__next__", self._next)

    def _patch(self, owner: Any, name: str, make: Any) -> None:
        original = getattr(owner, name)
        wrapper = make(original)
        wrapper.__wrapped__ = original
        setattr(owner, name, wrapper)
        self._patched.append((owner, name, original, wrapper))

    def _search_root(self, mm: Any) -> None:
        self._global = [
            mm.register_module_forward_pre_hook(self._guard(self._global_pre)),
            mm.register_module_forward_hook(self._guard(self._global_post)),
        ]

    def uninstall(self) -> None:
        """Remove every hook and patch (close, or the script instruments itself)."""
        self.steps = self.spans = False
        for h in self._handles + self._global + self._root_hooks:
            h.remove()
        self._handles, self._global, self._root_hooks = [], [], []
        for owner, name, original, wrapper in self._patched:
            if getattr(owner, name, None) is wrapper:
                setattr(owner, name, original)
        self._patched = []

    def yield_steps(self) -> None:
        """An explicit ``tracer.step``: the script numbers its steps itself."""
        self.steps = False
        if not self.spans:
            self.uninstall()

    def yield_spans(self) -> None:
        """An explicit span of one of the automatic names: the script draws its own."""
        self.spans = False
        for h in self._global + self._root_hooks:
            h.remove()
        self._global, self._root_hooks = [], []
        if not self.steps:
            self.uninstall()

    def _guard(self, fn: Any) -> Any:
        def hook(*args: Any, **kwargs: Any) -> Any:
            if not self.tr.enabled:
                return None
            try:
                fn(*args, **kwargs)
            except Exception as exc:
                self.tr.fail(exc, "automatic spans")
            return None

        return hook

    # -- steps ------------------------------------------------------------------------------
    def _begin(self) -> None:
        """The step of whatever happens now (begun at the first event of it)."""
        tr = self.tr
        if self.steps and not self._in_step:
            start = self._data[0][0] if self._data else None
            tr.step(self._next_step, start_ns=start)
            self._next_step += 1
            self._in_step = True
        if self._data:
            for start, end in self._data:
                tr.buffers["spans"].add((tr.step_no, -1, "data", "data", start, end, "host", None))
            self._data = []
        if self._counted_step != tr.step_no:
            self._counted_step = tr.step_no
            self._fwd = self._bwd = 0

    def _end(self) -> None:
        if self.steps and self._in_step:
            self.tr.end_step()
            self._in_step = False

    # -- optimizer ----------------------------------------------------------------------------
    def _opt_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self._primary is None:
            self._primary = weakref.ref(opt)
        self._begin()
        self._depth = 0  # a forward that raised left its depth behind
        if self.spans:
            span = Span(self.tr, "optimizer", "compute", -1)
            span.__enter__()
            self._opt_spans[id(opt)] = span

    def _opt_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        span = self._opt_spans.pop(id(opt), None)
        if span is not None:
            span.__exit__(None, None, None)
        if self._primary is not None and self._primary() is opt:
            self._end()

    # -- the outermost module ---------------------------------------------------------------
    def _global_pre(self, module: Any, args: Any) -> None:
        if self._depth == 0 and self._root is None and _has_params(module):
            self._choose(module)
            self._depth += 1
            self._fwd_pre(module, args)  # this very call is the first forward
            return
        self._depth += 1

    def _global_post(self, module: Any, args: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)

    def _choose(self, module: Any) -> None:
        """``module`` is the root: hook it alone, drop the global hooks."""
        self._root = weakref.ref(module)
        for h in self._global:
            h.remove()
        self._global = []
        if not self.spans:
            return
        self._root_hooks = [
            module.register_forward_pre_hook(self._guard(self._fwd_pre)),
            module.register_forward_hook(self._guard(self._fwd_post), always_call=True),
        ]

    def _fwd_pre(self, module: Any, args: Any) -> None:
        if not self.spans:
            return

        self._begin()
        span = Span(self.tr, "forward", "compute", self._fwd)
        self._fwd += 1
        span.__enter__()
        self._fwd_stack.append(span)

    def _fwd_post(self, module: Any, args: Any, output: Any) -> None:
        if self._fwd_stack:
            self._fwd_stack.pop().__exit__(None, None, None)
        self._restart_opt_spans()

    def _restart_opt_spans(self) -> None:
        """A forward or backward ran inside an optimizer's step: a closure (Lightning's automatic
        optimization passes one, as LBFGS needs). The optimizer span starts again after it, so
        that it holds the update alone and not the forward and backward it evaluated."""
        for span in self._opt_spans.values():
            if span.start is not None:
                span.start = self.tr.stamp(span.cuda)
                span.restart_cpu()

    # -- backward and data ------------------------------------------------------------------
    def _backward(self, original: Any) -> Any:
        def backward(*args: Any, **kwargs: Any) -> Any:
            tr = self.tr
            if not (self.spans and tr.enabled):
                return original(*args, **kwargs)
            try:
                self._begin()
                self._depth = 0
                span = Span(tr, "backward", "compute", self._bwd)
                self._bwd += 1
            except Exception as exc:
                tr.fail(exc, "automatic spans")
                return original(*args, **kwargs)
            with span:
                out = original(*args, **kwargs)
            if self._opt_spans:
                try:
                    self._restart_opt_spans()
                except Exception as exc:
                    tr.fail(exc, "automatic spans")
            return out

        return backward

    def _next(self, original: Any) -> Any:
        from tracer.clock import now_ns

        def __next__(it: Any) -> Any:
            if not (self.spans and self.tr.enabled):
                return original(it)
            start = now_ns()
            out = original(it)  # StopIteration ends the epoch: no data span, no step
            end = now_ns()
            tr = self.tr
            if not self.steps:  # the script numbers its steps: the current one
                tr.buffers["spans"].add((tr.step_no, -1, "data", "data", start, end, "host", None))
                return out
            self._data.append((start, end))
            if len(self._data) > 64:  # a loader read with no training: keep the newest
                del self._data[:-64]
            return out

        return __next__


def _has_params(module: Any) -> bool:
    return next(module.parameters(), None) is not None
