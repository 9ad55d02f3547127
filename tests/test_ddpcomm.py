"""tracer/ddpcomm.py's bookkeeping of DDP's bucket all-reduces: when the rank's wait for each
begins, and which modules and built-in hooks it takes (no rank started; the live runs are in
test_compiled_ddp.py)."""

from __future__ import annotations

import types

import torch.distributed as dist

from tracer.ddpcomm import builtin_hook, defer_waits, hookable, mark_waits


def _row(issue: int, start: int | None = None, end: int | None = None) -> list:
    """A collectives row as the recorder holds it: issue at 9, start at 10, end at 11."""
    row: list = [0, -1, "all_reduce", "world", 4, 1, -1, 8, "float32", issue, issue, end, "host"]
    if start is not None:
        row[10] = start
    return row


def test_a_bucket_still_in_flight_waits_from_the_last_bucket():
    early, done, waited = _row(100), _row(110, end=150), _row(120, start=170)
    defer_waits([early, done, waited])
    assert early[10] is None  # its wait is to come
    assert done[10] == 110  # ended: left as it was
    assert waited[10] == 170  # already waiting: left as it was
    last = _row(200)
    defer_waits([last])
    mark_waits([early, done, waited, last], 210)
    assert (early[10], last[10], waited[10]) == (210, 210, 210)
    assert done[10] == 110


def test_a_wait_never_moves_back():
    row = _row(100, start=300)
    mark_waits([row], 250)
    assert row[10] == 300


def test_only_host_modules_with_the_cpp_reducer_are_hooked():
    plain = types.SimpleNamespace(reducer=object(), device_type="cpu", mixed_precision=None)
    assert hookable(plain)
    assert not hookable(types.SimpleNamespace(**{**vars(plain), "device_type": "cuda"}))
    assert not hookable(types.SimpleNamespace(**{**vars(plain), "mixed_precision": object()}))
    assert not hookable(types.SimpleNamespace(**{**vars(plain), "_use_python_reducer": True}))
    assert not hookable(types.SimpleNamespace(**{**vars(plain), "reducer": None}))


def test_built_in_hooks_map_to_what_they_do():
    assert builtin_hook(dist.BuiltinCommHookType.ALLREDUCE) is None  # the default: ours
    fp16 = builtin_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    assert fp16.__name__ == "fp16_compress_hook"
    assert builtin_hook("something new") is False
