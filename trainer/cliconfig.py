"""``megascope train``'s settings: flags, an optional TOML file, and their validation.

Precedence: the defaults of :mod:`trainer.config`, then the TOML file (``--config``), then the
flags — a flag given on the command line always wins. The TOML file holds the three tables of
:func:`trainer.config.configs_from_mapping` (``[model]``, ``[parallel]``, ``[train]``) plus an
optional ``[run]`` table with the launcher's own settings (``out``, ``inject``, ``trace``,
``hang_timeout``). Everything is checked here, before any process starts: the mesh against the
model, the fault specs against the world size, the device against the machine. Every problem
raises :class:`tracer.cliutil.UsageError` with one line, which the CLI turns into exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib

from tracer.cliutil import ArgumentParser, UsageError
from tracer.faults import Fault, FaultSpecError, parse_fault
from trainer.config import (
    PRESETS,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    configs_from_mapping,
)

_RUN_KEYS = ("out", "inject", "trace", "hang_timeout")
DEFAULT_HANG_TIMEOUT_S = 60.0
# flag dest -> (config section, key)
# (--model first: it replaces the file's [model] table, which later model flags then amend)
_FLAG_KEYS: dict[str, tuple[str, str]] = {
    "model": ("model", "preset"),
    "dp": ("parallel", "dp"),
    "pp": ("parallel", "pp"),
    "tp": ("parallel", "tp"),
    "cp": ("parallel", "cp"),
    "sp": ("parallel", "sp"),
    "ep": ("parallel", "ep"),
    "experts": ("model", "experts"),
    "top_k": ("model", "top_k"),
    "data": ("train", "data"),
    "steps": ("train", "steps"),
    "microbatches": ("train", "microbatches"),
    "micro_batch_size": ("train", "micro_batch_size"),
    "device": ("train", "device"),
    "seed": ("train", "seed"),
    "checkpoint_every": ("train", "checkpoint_every"),
    "checkpoint_async": ("train", "checkpoint_async"),
    "lr": ("train", "lr"),
    "dtype": ("train", "dtype"),
    "recompute": ("train", "recompute"),
    "compile": ("train", "compile"),
    "optimizer_offload": ("train", "optimizer_offload"),
}


@dataclass(frozen=True)
class RunSettings:
    """What the launcher needs besides the model, the layout and the training run."""

    out: str
    injections: tuple[str, ...] = ()
    faults: tuple[Fault, ...] = ()
    trace: bool = True
    hang_timeout: float = DEFAULT_HANG_TIMEOUT_S
    resume: bool = False
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    stop_after: int | None = None


@dataclass(frozen=True)
class LaunchConfig:
    """What ``megascope train`` launches: the model, the mesh, the training and the launcher's own
    settings."""

    model: ModelConfig
    parallel: ParallelConfig
    train: TrainConfig
    run: RunSettings

    @property
    def world_size(self) -> int:
        """Ranks in the mesh."""
        return self.parallel.world_size

    def to_mapping(self) -> dict[str, Any]:
        """JSON-ready form; :func:`from_mapping` reads it back (the ranks do)."""
        run = dataclasses.asdict(self.run)
        run["faults"] = list(self.run.injections)
        return {
            "model": dataclasses.asdict(self.model),
            "parallel": dataclasses.asdict(self.parallel),
            "train": dataclasses.asdict(self.train),
            "run": run,
        }


def from_mapping(data: Mapping[str, Any]) -> LaunchConfig:
    """Inverse of :meth:`LaunchConfig.to_mapping`."""
    model, parallel, train = configs_from_mapping(
        {k: data[k] for k in ("model", "parallel", "train")}
    )
    run = dict(data["run"])
    specs = tuple(run.pop("faults", ()))
    run["injections"] = specs
    run["faults"] = tuple(parse_fault(s, parallel.world_size) for s in specs)
    return LaunchConfig(model, parallel, train, RunSettings(**run))


def _int_at_least(low: int):
    """An argparse type: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_count = _int_at_least(0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1], got {text}")
    return value


def build_parser() -> ArgumentParser:
    """The arguments of ``megascope train``."""
    p = ArgumentParser(prog="megascope train", description="Train the parallel GPT with torchrun.")
    p.add_argument("--config", metavar="FILE.toml", help="TOML file; flags override it")
    for axis in ("dp", "pp", "tp", "cp"):
        p.add_argument(f"--{axis}", type=_positive_int, help=f"{axis} size")
    p.add_argument("--sp", action=argparse.BooleanOptionalAction, help="sequence parallelism")
    p.add_argument("--ep", type=_positive_int, help="expert-parallel size (carved from dp)")
    p.add_argument("--experts", type=_count, help="experts per MLP (0: dense)")
    p.add_argument("--top-k", type=_positive_int, help="experts per token")
    p.add_argument(
        "--data",
        choices=("fixed", "varlen"),
        help="fixed: windows of seq_len tokens; varlen: packed documents of heavy-tailed lengths",
    )
    p.add_argument("--steps", type=_positive_int, help="train until this many steps are done")
    p.add_argument("--microbatches", type=_positive_int, help="microbatches per step")
    p.add_argument("--micro-batch-size", type=_positive_int, help="sequences per microbatch")
    p.add_argument("--model", choices=sorted(PRESETS), help="model preset")
    p.add_argument("--device", choices=("cpu", "cuda"))
    p.add_argument("--dtype", choices=("fp32", "bf16"))
    p.add_argument(
        "--recompute",
        choices=("none", "full", "selective"),
        help="activation recompute: every block's forward again in the backward (full), or "
        "only attention's (selective)",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="torch.compile each block (default: on with --device cuda, falling back to eager "
        "where the toolchain cannot compile; off on CPU)",
    )
    p.add_argument("--lr", type=_positive_float)
    p.add_argument(
        "--optimizer-offload",
        type=_fraction,
        metavar="FRACTION",
        help="share of each rank's optimizer state (Adam moments and masters) kept and updated "
        "on the host, its copies overlapped with the next step's forward (adamw only)",
    )
    p.add_argument("--seed", type=int)
    p.add_argument("--checkpoint-every", type=_count, metavar="N", help="0: never")
    p.add_argument(
        "--checkpoint-async",
        action="store_true",
        default=None,
        help="write checkpoints in the background while training goes on (the step only "
        "copies the state to host memory)",
    )
    p.add_argument("--out", metavar="RUN", help="run directory (default: runs/<run id>)")
    p.add_argument("--inject", action="append", metavar="SPEC", help="fault (repeatable)")
    p.add_argument("--no-trace", action="store_true", help="run without the tracer")
    p.add_argument(
        "--hang-timeout",
        type=_positive_float,
        metavar="SECONDS",
        help=f"no progress for this long is a hang (default {DEFAULT_HANG_TIMEOUT_S:g})",
    )
    p.add_argument("--resume", action="store_true", help="continue RUN from its checkpoint")
    p.add_argument(
        "--stop-after",
        type=_positive_int,
        metavar="N",
        help="end this launch once N steps are done (the schedule still spans --steps)",
    )
    p.add_argument("--nnodes", type=_positive_int, default=1, help="passed to torchrun")
    p.add_argument("--node-rank", type=int, default=0, help="passed to torchrun")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="passed to torchrun")
    return p


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise UsageError(f"--config {path}: no such file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, IsADirectoryError) as e:
        first = str(e).splitlines()[0] if str(e) else e.__class__.__name__
        raise UsageError(f"--config {path}: not valid TOML ({first})") from None


def _merge(data: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The TOML tables with every flag that was given written over them."""
    merged = {k: dict(v) if isinstance(v, Mapping) else v for k, v in data.items()}
    for dest, (section, key) in _FLAG_KEYS.items():
        value = getattr(args, dest)
        if value is None:
            continue
        table = merged.setdefault(section, {})
        if not isinstance(table, dict):
            raise UsageError(f"[{section}] must be a table")
        if section == "model" and key == "preset":
            # --model picks a whole model: the file's [model] keys describe another one
            table = {k: v for k, v in table.items() if k == "preset"}
            merged[section] = table
        table[key] = value
    return merged


def _run_settings(section: Any, args: argparse.Namespace, world: int) -> RunSettings:
    if section is not None and not isinstance(section, Mapping):
        raise UsageError("[run] must be a table")
    section = dict(section or {})
    unknown = sorted(set(section) - set(_RUN_KEYS))
    if unknown:
        raise UsageError(f"[run] has unknown keys: {', '.join(unknown)}")
    inject = section.get("inject", [])
    if not isinstance(inject, list) or not all(isinstance(x, str) for x in inject):
        raise UsageError("[run] inject must be a list of fault specs (strings)")
    specs = inject + list(args.inject or [])
    try:
        faults = tuple(parse_fault(s, world) for s in specs)
    except FaultSpecError as e:
        raise UsageError(f"--inject {e}") from None
    hang = args.hang_timeout or section.get("hang_timeout", DEFAULT_HANG_TIMEOUT_S)
    if isinstance(hang, bool) or not isinstance(hang, (int, float)) or not 0 < hang < math.inf:
        raise UsageError(f"[run] hang_timeout must be a number of seconds > 0, got {hang!r}")
    if not isinstance(section.get("trace", True), bool):
        raise UsageError("[run] trace must be true or false")
    out = args.out or section.get("out")
    if not out:
        from tracer.rundir import new_run_id

        out = os.path.join("runs", new_run_id())
    if args.nnodes > 1 and world % args.nnodes:
        raise UsageError(f"--nnodes {args.nnodes} must divide the world size {world}")
    if not 0 <= args.node_rank < args.nnodes:
        raise UsageError(f"--node-rank must be in 0..{args.nnodes - 1}, got {args.node_rank}")
    return RunSettings(
        out=str(out),
        injections=tuple(s.strip() for s in specs),
        faults=faults,
        trace=not args.no_trace and bool(section.get("trace", True)),
        hang_timeout=float(hang),
        resume=bool(args.resume),
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        stop_after=args.stop_after,
    )


def resolve(argv: list[str]) -> LaunchConfig:
    """Parse and validate ``megascope train``'s arguments; one-line UsageError on any problem."""
    args = build_parser().parse_args(argv)
    data = _read_toml(args.config) if args.config else {}
    run_section = data.pop("run", None)
    try:
        model, parallel, train = configs_from_mapping(_merge(data, args))
    except ValueError as e:
        raise UsageError(str(e).splitlines()[0] if str(e) else "invalid configuration") from None
    run = _run_settings(run_section, args, parallel.world_size)
    if train.checkpoint_async and not train.checkpoint_every:
        raise UsageError("--checkpoint-async needs --checkpoint-every N (N >= 1)")
    for f in run.faults:
        if f.kind == "hot_expert" and not 0 <= f.expert < model.experts:
            raise UsageError(
                f"--inject {f.spec!r}: expert {f.expert} is not one of the model's "
                f"{model.experts} experts (--experts N)"
            )
    if train.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available on this machine")
        local = parallel.world_size // run.nnodes
        if local > torch.cuda.device_count():
            raise UsageError(
                f"{local} ranks per node need {local} GPUs, found {torch.cuda.device_count()}"
            )
    return LaunchConfig(model, parallel, train, run)
