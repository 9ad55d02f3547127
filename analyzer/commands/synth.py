"""``megascope synth``: simulate a dp x pp x tp (x cp) cluster and write its run directory.

    megascope synth --mesh dp=64,pp=8,tp=8 --steps 50 --inject slow_rank:rank=3,factor=1.2 --out RUN

Faults use the SPEC's injection language (``--inject``, repeatable); ``--imbalance``,
``--throttle``, ``--regression`` and ``--work-imbalance`` add conditions the other detectors
look for; ``--experts N --ep N`` makes every MLP a mixture of N experts sharded over groups of
ep data-parallel ranks (``hot_expert`` needs it); ``--vpp N`` runs Megatron's interleaved 1F1B schedule over N model chunks per stage;
``--hw-classes`` puts ranges of ranks on hardware classes of their own speed. The run is
deterministic for a given ``--seed``. The run is written in the compacted layout (a file per
pipeline stage and table, docs/spec.md §2), or with ``--layout rank`` a folder per rank as the
tracer writes; the last line gives its rows and bytes per event. Bad input ends with one line and
exit status 2.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

from analyzer.synth import (
    Extras,
    SynthConfig,
    SynthError,
    parse_hosts,
    parse_hw_classes,
    parse_imbalance,
    parse_injections,
    parse_mesh,
    parse_throttle,
    synthesize,
)
from analyzer.synth.run import LAYOUTS
from tracer.cliutil import ArgumentParser, UsageError


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="megascope synth", description=__doc__.splitlines()[0])
    _add_run_args(p)
    _add_model_args(p)
    _add_fault_args(p)
    _add_output_args(p)
    return p


def _add_run_args(p: ArgumentParser) -> None:
    """The run: its mesh, its length, where it goes, its faults and its randomness."""
    p.add_argument("--mesh", required=True, help="e.g. dp=64,pp=8,tp=8 (cp=N optional)")
    p.add_argument("--steps", type=int, required=True, help="training steps to simulate")
    p.add_argument("--out", required=True, help="run directory to write")
    p.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="SPEC",
        help="a fault (SPEC §5), repeatable",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--microbatches", type=int, default=None, help="per step (default: 2 x pp, at least 4)"
    )
    p.add_argument("--noise", type=float, default=0.02, help="lognormal sigma of compute times")
    p.add_argument(
        "--spread", type=float, default=0.004, help="lognormal sigma of ranks' lasting speed"
    )


def _add_model_args(p: ArgumentParser) -> None:
    """The model's shape and schedule."""
    p.add_argument(
        "--no-sp",
        action="store_true",
        help="tensor parallel all_reduce instead of SP all_gather/reduce_scatter",
    )
    p.add_argument(
        "--detail",
        choices=("fine", "coarse"),
        default="fine",
        help="coarse: one TP collective of each kind per pass",
    )
    p.add_argument("--layers-per-stage", type=int, default=4)
    p.add_argument(
        "--vpp",
        type=int,
        default=1,
        metavar="N",
        help="model chunks per stage: N > 1 runs the interleaved 1F1B schedule",
    )
    p.add_argument(
        "--experts",
        type=int,
        default=0,
        metavar="N",
        help="a mixture of N experts in every MLP (0: dense)",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        metavar="N",
        help="experts sharded over groups of N data-parallel ranks (divides dp and --experts)",
    )


def _add_fault_args(p: ArgumentParser) -> None:
    """Slowness built into the run besides --inject: stages, ranks, drift, hosts, classes."""
    p.add_argument("--imbalance", action="append", default=[], metavar="stage=S,factor=F")
    p.add_argument("--throttle", action="append", default=[], metavar="rank=R,factor=F[,step=S]")
    p.add_argument(
        "--regression", type=float, default=1.0, help="step time drifts up to this factor"
    )
    p.add_argument(
        "--work-imbalance",
        type=float,
        default=0.0,
        metavar="SIGMA",
        help="lognormal sigma of each dp rank's forward/backward work per step (0: off)",
    )
    p.add_argument(
        "--hosts",
        metavar="H1,H2,...|@FILE",
        help="place ranks on these hosts, 8 per host in rank order (default node0, node1, ...)",
    )
    p.add_argument(
        "--hw-classes",
        metavar="NAME:FIRST-LAST:SPEED,...",
        help="hardware classes: ranks FIRST..LAST run on NAME, their compute SPEED times as "
        "long (e.g. h200:0-6143:1.0,h100:6144-12287:1.15)",
    )


def _add_output_args(p: ArgumentParser) -> None:
    """How the run is written."""
    p.add_argument("--jobs", type=int, default=2, help="threads writing Parquet parts")
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="ranks",
        help="ranks: a file per pipeline stage and table, as megascope compact leaves a run "
        "(default); rank: a folder per rank, as the tracer writes",
    )
    p.add_argument("--force", action="store_true", help="replace --out if it holds a run")
    p.add_argument("--quiet", action="store_true")


def _prepare_out(out: str, force: bool) -> None:
    if os.path.isfile(out):
        raise UsageError(f"--out {out}: is a file")
    if os.path.isdir(out) and os.listdir(out):
        if not force:
            raise UsageError(f"--out {out}: exists and is not empty (use --force to replace a run)")
        if not os.path.isfile(os.path.join(out, "run.json")):
            raise UsageError(f"--out {out}: not a megascope run; refusing to replace it")
        shutil.rmtree(out)


def config_from_args(args) -> tuple[SynthConfig, list[str]]:
    """Validate every option into a :class:`SynthConfig` (raises :class:`SynthError`)."""
    mesh = parse_mesh(args.mesh)
    world = mesh["dp"] * mesh["pp"] * mesh["tp"] * mesh["cp"]
    faults = parse_injections(args.inject, world)
    extras = Extras(
        imbalance=tuple(parse_imbalance(t, mesh["pp"]) for t in args.imbalance),
        throttle=tuple(parse_throttle(t, world) for t in args.throttle),
        regression=args.regression,
        work_imbalance=args.work_imbalance,
    )
    if args.layers_per_stage < 1:
        raise SynthError(f"--layers-per-stage must be >= 1, got {args.layers_per_stage}")
    if not 0.0 <= args.spread <= 0.5:
        raise SynthError(f"--spread must be within 0..0.5, got {args.spread}")
    from analyzer.synth import ModelShape

    cfg = SynthConfig(
        mesh=mesh,
        steps=args.steps,
        microbatches=args.microbatches if args.microbatches is not None else max(4, 2 * mesh["pp"]),
        faults=faults,
        seed=args.seed,
        noise=args.noise,
        rank_spread=args.spread,
        sp=not args.no_sp,
        detail=args.detail,
        vpp=args.vpp,
        model=ModelShape(layers_per_stage=args.layers_per_stage),
        extras=extras,
        experts=args.experts,
        ep=args.ep,
        hosts=parse_hosts(args.hosts, world) if args.hosts else (),
        hw_classes=parse_hw_classes(args.hw_classes, world) if args.hw_classes else (),
    )
    return cfg, [s.strip() for s in args.inject]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``megascope synth``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        cfg, injections = config_from_args(args)
        from analyzer.synth.config import validate

        validate(cfg)
    except SynthError as e:
        raise UsageError(str(e)) from None
    _prepare_out(args.out, args.force)
    t0 = time.monotonic()

    def progress(msg: str) -> None:
        if not args.quiet and sys.stderr.isatty():
            print(f"\rsynth: {msg}", end="", file=sys.stderr, flush=True)

    rows: dict[str, int] = {}
    meta = synthesize(
        cfg,
        args.out,
        injections,
        progress=progress,
        jobs=max(1, args.jobs),
        layout=args.layout,
        rows=rows,
    )
    if not args.quiet:
        if sys.stderr.isatty():
            print(file=sys.stderr)
        s = meta["summary"]
        med = s["median_step_ms"]
        print(
            f"synth: {cfg.world_size} ranks ({args.mesh}), {s['steps']} steps, status {meta['status']}, "
            f"median step {med:.1f} ms, wrote {args.out} in {time.monotonic() - t0:.1f} s"
            if med is not None
            else f"synth: {cfg.world_size} ranks, status {meta['status']}, wrote {args.out}"
        )
        print(_size_line(args.out, rows))
    return 0


def _size_line(out: str, rows: dict[str, int]) -> str:
    """The run's Parquet bytes per row written (an event: a span, a collective, a sample)."""
    files = nbytes = 0
    for folder, _, names in os.walk(out):
        for name in names:
            if name.endswith(".parquet"):
                files += 1
                nbytes += os.path.getsize(os.path.join(folder, name))
    n = sum(rows.values())
    return (
        f"synth: {n:,} rows ({rows.get('collectives', 0):,} collectives, "
        f"{rows.get('spans', 0):,} spans) in {files:,} Parquet files, {nbytes / 2**20:,.1f} MiB: "
        f"{nbytes / max(n, 1):.1f} bytes per event"
    )
