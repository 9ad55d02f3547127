"""TraceML 0.5 and megascope on the same live runs: which rank each names as the slow one.

    .venv/bin/python bench/traceml_side_by_side.py                       # the default matrix
    .venv/bin/python bench/traceml_side_by_side.py --script ddp_buffers --repeats 1 --steps 16
    .venv/bin/python bench/traceml_side_by_side.py --traceml-site /tmp/traceml-site --keep runs/tml

The matrix: script x slow rank (1) x factor (1.5) x repeats (3), plus 2 healthy runs per script
(``--slow-rank -1``), 4 gloo ranks each, held under the machine's CPU lock (``flock
/tmp/megascope-cpu.lock``) run by run. The scripts: tests/scripts/ddp_buffers.py
(``ddp_buffers``: plain DDP, BatchNorm buffers, the slow rank burns after its forward) and
examples/ddp.py with and without ``--buffers`` (``gpt_buffers``, ``gpt``: the slow rank burns
in its forward and backward); ``--script`` takes one of these names or a script as
bench/framework_accuracy.py names it (``NAME``, ``NAME=PATH``, ``:ARG,ARG``).

Both tools observe the same processes. TraceML needs its step context in the training loop, so
the bench writes a TraceML variant of each script into a temporary folder: the script's own
code with TraceML's three lines added (``import traceml_ai as traceml``,
``traceml.init(mode="auto")`` right after ``init_process_group`` or ``Accelerator(...)``, and
``with traceml.trace_step(model):`` around the body of the step loop ``for ... in
range(args.steps)``, or over the data loader). A script whose framework runs the loop (the
Hugging Face Trainer, Lightning) is left as it is: TraceML's launcher instruments those
frameworks itself, as their users run it.
TraceML's launcher starts the ranks (``traceml run SHIM --nproc-per-node 4 --args VARIANT
ARGS``: torchrun under TraceML's executor and aggregator), and SHIM hands each rank to
megascope's ``tracer.run`` with ``MEGASCOPE_TRACE`` set, which attaches megascope's tracer after
``init_process_group`` and runs the variant: megascope attaches as to any unmodified script.

The verdicts: TraceML's per-rank verdict is a ``*STRAGGLER`` issue of the Step Time section of
its ``final_summary.json`` (``COMPUTE_STRAGGLER``, ``INPUT_STRAGGLER``, ``H2D_STRAGGLER`` or
``STRAGGLER``) and the culprit rank it names; megascope's is a ``straggler`` finding of
``analyzer.findings.analyze``. A false alarm: a healthy run with a TraceML straggler issue, or
with a megascope straggler, slow_link, hang, crash or regression finding. TraceML's straggler
rule needs the ranks' input wait, which it times at a DataLoader's ``next``: a loop without a
DataLoader (ddp_buffers trains on fixed tensors) gets ``INCOMPLETE_DATA`` (missing input_wait)
from it, and no straggler.

TraceML is imported from ``--traceml-site DIR`` (default: a cache under the temp dir, where the
bench installs ``traceml-ai==0.5.0`` from PyPI, and those of its dependencies the project's
environment lacks, when TraceML cannot be imported from it); the project's environment is left
as it is, and DIR is on ``PYTHONPATH`` only for the runs.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

# framework_accuracy puts the repository on sys.path
from framework_accuracy import ALARMS, LOCK, ROOT, Script, free_port, parse_script, pct

from analyzer.db import open_run
from analyzer.findings import analyze

TRACEML = "0.5.0"
TOOLS = ("traceml", "megascope")
FACTORS = (1.5,)
# the default rows: plain DDP with BatchNorm buffers, the GPT of examples/ddp.py with and without
# a buffer that DDP broadcasts at the start of every forward
SCRIPTS = {
    "ddp_buffers": Script("ddp_buffers", os.path.join(ROOT, "tests", "scripts", "ddp_buffers.py")),
    "gpt_buffers": Script("gpt_buffers", os.path.join(ROOT, "examples", "ddp.py"), ("--buffers",)),
    "gpt": Script("gpt", os.path.join(ROOT, "examples", "ddp.py")),
}
# what each rank runs under TraceML's executor: megascope's tracer.run, given the variant
SHIM = "import sys\n\nfrom tracer.run import main\n\nsys.exit(main())\n"


@dataclass
class Verdicts:
    """One run and what each tool said of it."""

    script: str
    slow_rank: int  # -1: healthy
    factor: float
    repeat: int
    ok: bool  # the run finished and both tools reported
    traceml: str = ""  # TraceML's Step Time diagnosis (its first issue)
    traceml_ranks: tuple[tuple[int, ...], ...] = ()  # each straggler issue's (its culprit)
    megascope: str = ""  # megascope's first finding
    megascope_ranks: tuple[tuple[int, ...], ...] = ()  # the ranks of each straggler finding
    megascope_alarms: tuple[str, ...] = ()  # the kinds of its alarms

    def named(self, tool: str) -> bool:
        """The tool's straggler names the slow rank, and it alone."""
        return (self.slow_rank,) in getattr(self, f"{tool}_ranks")

    def wrong(self, tool: str) -> bool:
        """The tool names a rank other than the slow one as a straggler."""
        return any(r != (self.slow_rank,) for r in getattr(self, f"{tool}_ranks"))

    def alarm(self, tool: str) -> bool:
        return bool(self.megascope_alarms if tool == "megascope" else self.traceml_ranks)


class Instrument(ast.NodeTransformer):
    """TraceML's lines in a script: ``traceml.init`` after the process group's creation (a call
    of ``init_process_group``, or ``accelerator = Accelerator(...)``), the step context around
    the body of the step loop (``for ... in range(args.steps)``, over ``enumerate(loader(...))``
    as in examples/fsdp2_tp.py, or over the prepared ``loader`` as in
    examples/accelerate_loop.py)."""

    def __init__(self) -> None:
        self.inits = self.loops = 0

    def _init_after(self, node: ast.stmt) -> list[ast.stmt]:
        self.inits += 1
        return [node, ast.parse('traceml.init(mode="auto")').body[0]]

    def visit_Expr(self, node: ast.Expr) -> ast.AST | list[ast.stmt]:
        call = node.value
        if isinstance(call, ast.Call) and ast.unparse(call.func).endswith("init_process_group"):
            return self._init_after(node)
        return node

    def visit_Assign(self, node: ast.Assign) -> ast.AST | list[ast.stmt]:
        call = node.value
        if isinstance(call, ast.Call) and ast.unparse(call.func) == "Accelerator":
            return self._init_after(node)
        return node

    def visit_For(self, node: ast.For) -> ast.For:
        self.generic_visit(node)
        loop = ast.unparse(node.iter)
        if loop in ("range(args.steps)", "loader") or loop.startswith("enumerate(loader("):
            self.loops += 1
            step = ast.parse("traceml.trace_step(model)", mode="eval").body
            node.body = [ast.With(items=[ast.withitem(step)], body=node.body)]
        return node


# scripts whose framework runs the step loop: TraceML's launcher instruments these itself (its
# import hooks for the Hugging Face Trainer and Lightning), and the variant is the script as is
FRAMEWORK_LOOPS = ("transformers", "lightning")


def _imports(tree: ast.Module) -> set[str]:
    """The top-level packages ``tree`` imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def traceml_variant(script: Script, folder: str) -> str:
    """The script with TraceML's three lines added, written into ``folder``; its path."""
    with open(script.path) as f:
        tree = ast.parse(f.read(), script.path)
    edit = Instrument()
    tree = edit.visit(tree)
    auto = (edit.inits, edit.loops) == (0, 0) and bool(_imports(tree) & set(FRAMEWORK_LOOPS))
    if auto:
        path = os.path.join(folder, f"{script.name}_traceml.py")
        shutil.copyfile(script.path, path)
        return path
    if (edit.inits, edit.loops) != (1, 1):
        raise SystemExit(f"traceml_side_by_side: {script.path}: {edit.inits} init_process_group "
                         f"calls, {edit.loops} step loops; want one of each")  # fmt: skip
    # the import after the docstring and the __future__ imports
    at = next(i for i, s in enumerate(tree.body) if not (
        isinstance(s, ast.ImportFrom) and s.module == "__future__"
        or isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)))  # fmt: skip
    tree.body.insert(at, ast.parse("import traceml_ai as traceml").body[0])
    path = os.path.join(folder, f"{script.name}_traceml.py")
    with open(path, "w") as f:
        f.write(ast.unparse(ast.fix_missing_locations(tree)) + "\n")
    return path


def traceml_site(path: str | None) -> tuple[str, str]:
    """Where TraceML is imported from, and its version: ``path``, or the cache, installed into it
    when TraceML cannot be imported from there."""
    site = path or os.path.join(tempfile.gettempdir(), f"megascope-traceml-{TRACEML}")
    ok, said = import_traceml(site)
    if not ok and path is None:
        install(site)
        ok, said = import_traceml(site)
    if not ok:
        raise SystemExit(f"traceml_side_by_side: cannot import TraceML from {site}: {said}")
    return site, said


def import_traceml(site: str) -> tuple[bool, str]:
    """Whether TraceML's launcher and API import from ``site``; its version, or why not."""
    code = "import traceml_ai.api, traceml_ai.launcher.cli; print(traceml_ai.__version__)"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": site},
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode == 0:
        return True, done.stdout.strip()
    return False, (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]


def install(site: str) -> None:
    """traceml-ai from PyPI into ``site``, and those of its dependencies this environment lacks."""
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
           "--upgrade", "--target", site]  # fmt: skip
    print(f"installing traceml-ai=={TRACEML} into {site}", flush=True)
    pip_install([*pip, "--no-deps", f"traceml-ai=={TRACEML}"], site)
    dist = next(iter(importlib.metadata.distributions(name="traceml-ai", path=[site])))
    missing = [r for r in dist.requires or [] if ";" not in r and not installed(r)]
    if missing:
        pip_install([*pip, *missing], site)


def pip_install(cmd: list[str], site: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise SystemExit(f"traceml_side_by_side: cannot install TraceML into {site}: {why}")


def installed(requirement: str) -> bool:
    name = re.match(r"[A-Za-z0-9._-]+", requirement)
    try:
        importlib.metadata.version(name.group() if name else requirement)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def run_both(script: Script, variant: str, shim: str, site: str, run: str, slow: int,
             factor: float, steps: int, timeout: float) -> bool:  # fmt: skip
    """One 4-rank run under TraceML's launcher with megascope's tracer attached, under the CPU
    lock: megascope's run directory is ``run/megascope``, TraceML's ``run/traceml``."""
    cmd = ["flock", LOCK, sys.executable, "-m", "traceml_ai.launcher.cli", "run", shim,
           "--nproc-per-node", "4", "--master-port", str(free_port()), "--aggregator-port",
           str(free_port()), "--logs-dir", run, "--run-name", "traceml", "--args", variant,
           "--steps", str(steps), "--slow-rank", str(slow), "--slow-factor", str(factor),
           *script.args]  # fmt: skip
    path = os.pathsep.join([ROOT, os.path.dirname(script.path), site])
    env = {**os.environ, "MEGASCOPE_TRACE": os.path.join(run, "megascope"), "PYTHONPATH": path}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher, its aggregator and its ranks
        proc.communicate()
        print(f"  {run}: no end after {timeout:.0f} s", file=sys.stderr)
        return False
    with open(os.path.join(run, "output.txt"), "w") as f:
        f.write(out)
    if proc.returncode != 0:
        print(f"  {run}: exit {proc.returncode}: {out.strip()[-300:]}", file=sys.stderr)
    return proc.returncode == 0


def traceml_verdict(run: str) -> tuple[str, tuple[tuple[int, ...], ...]] | None:
    """TraceML's Step Time diagnosis and the ranks of each of its straggler issues; None
    without a final summary."""
    path = os.path.join(run, "traceml", "final_summary.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        step_time = json.load(f)["step_time"]
    issues = step_time["issues"]  # a straggler issue's ranks: its culprit
    ranks = tuple(tuple(i["ranks"]) for i in issues if i["kind"].endswith("STRAGGLER"))
    return step_time["diagnosis"]["kind"], ranks


def megascope_verdict(run: str) -> tuple[str, tuple[tuple[int, ...], ...], tuple[str, ...]]:
    """megascope's first finding, the ranks of each straggler finding, the kinds of its
    alarms."""
    db = open_run(os.path.join(run, "megascope"))
    try:
        findings = analyze(db)["findings"]
    finally:
        db.close()
    top = f"{findings[0]['kind']} {findings[0]['ranks']}" if findings else "nothing"
    ranks = tuple(tuple(f["ranks"]) for f in findings if f["kind"] == "straggler")
    return top, ranks, tuple(sorted({f["kind"] for f in findings if f["kind"] in ALARMS}))


def plan(args: argparse.Namespace) -> list[tuple[Script, int, float, int]]:
    scripts = [SCRIPTS.get(s) or parse_script(s) for s in args.script or SCRIPTS]
    ranks = [int(r) for r in args.ranks.split(",")]
    factors = [float(f) for f in args.factors.split(",")]
    cases = []
    for script in scripts:
        cases += [(script, rank, factor, rep) for factor in factors for rank in ranks
                  for rep in range(args.repeats)]  # fmt: skip
        cases += [(script, -1, 1.0, rep) for rep in range(args.healthy)]
    return cases


def shown(ranks: tuple[tuple[int, ...], ...], slow: int) -> str:
    """The ranks a tool named, the slow one marked."""
    if not ranks:
        return "–"
    return ", ".join(f"{list(r)}" + (" ✓" if r == (slow,) else " ✗") for r in ranks)


def side_by_side(results: list[Verdicts]) -> None:
    """Run by run: what each tool named."""
    head = ("script", "slow rank", "factor", "#", "TraceML diagnosis", "TraceML names",
            "megascope first finding", "megascope straggler")  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in results:
        cells = [r.script, str(r.slow_rank) if r.slow_rank >= 0 else "healthy",
                 f"{r.factor:g}x" if r.slow_rank >= 0 else "–", str(r.repeat)]  # fmt: skip
        if r.ok:
            cells += [r.traceml, shown(r.traceml_ranks, r.slow_rank), r.megascope,
                      shown(r.megascope_ranks, r.slow_rank)]  # fmt: skip
        else:
            cells += ["did not finish"] + ["–"] * 3
        print("| " + " | ".join(cells) + " |")


def summarize(results: list[Verdicts]) -> None:
    """One row per script and one for all: how often each tool named the slow rank, named
    another, raised an alarm on a healthy run, and whether megascope named the slow rank in
    every run where TraceML did."""
    head = ("script", "runs", "TraceML named the slow rank", "megascope named it",
            "TraceML named another", "megascope named another", "TraceML: healthy alarms",
            "megascope: healthy alarms", "megascope named it in every run where TraceML did")  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    scripts = list(dict.fromkeys(r.script for r in results))
    rows = [(s, [r for r in results if r.script == s]) for s in scripts]
    for script, rs in [*rows, *([("all", results)] if len(scripts) > 1 else [])]:
        faults = [r for r in rs if r.ok and r.slow_rank >= 0]
        healthy = [r for r in rs if r.ok and r.slow_rank < 0]
        missed = [r for r in faults if r.named("traceml") and not r.named("megascope")]
        cells = [script, f"{len(faults)} + {len(healthy)}"]
        cells += [pct(sum(r.named(t) for r in faults), len(faults)) for t in TOOLS]
        cells += [pct(sum(r.wrong(t) for r in faults), len(faults)) for t in TOOLS]
        cells += [f"{sum(r.alarm(t) for r in healthy)} of {len(healthy)}" if healthy else "–"
                  for t in TOOLS]  # fmt: skip
        cells.append("–" if not faults else f"no ({len(missed)} runs)" if missed else "yes")
        print("| " + " | ".join(cells) + " |")
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"\n{len(failed)} runs did not finish or lack a report: "
              + ", ".join(f"{r.script} rank {r.slow_rank} #{r.repeat}" for r in failed))  # fmt: skip
    both = [r for r in results if r.ok and r.slow_rank >= 0]
    every = all(r.named("megascope") for r in both if r.named("traceml"))
    print(f"\nmegascope named it in every run where TraceML did: {'yes' if every else 'no'}")


def run_name(script: str, slow: int, factor: float, rep: int) -> str:
    tag = "healthy" if slow < 0 else f"r{slow}-x{factor:g}"
    return f"{script}-{tag}-{rep}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--script", action="append",
                   help=f"one of {', '.join(SCRIPTS)}, or NAME, NAME=PATH, either with :ARG,ARG "
                   "(as bench/framework_accuracy.py takes it); repeatable")  # fmt: skip
    p.add_argument("--ranks", default="1", help="slow ranks to place the fault on")
    p.add_argument("--factors", default=",".join(f"{f:g}" for f in FACTORS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--healthy", type=int, default=2, help="healthy runs per script")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--traceml-site", help="import TraceML from this folder (default: a cache "
                   f"under the temp dir, traceml-ai=={TRACEML} installed into it from PyPI)")  # fmt: skip
    p.add_argument("--keep", help="keep the runs here (and results.json)")
    args = p.parse_args()
    site, version = traceml_site(args.traceml_site)
    cases = plan(args)
    base = args.keep or tempfile.mkdtemp(prefix="traceml-side-by-side-")
    os.makedirs(base, exist_ok=True)
    variants = os.path.join(base, "variants")
    os.makedirs(variants, exist_ok=True)
    shim = os.path.join(variants, "megascope_shim.py")
    with open(shim, "w") as f:
        f.write(SHIM)
    scripts = {s.name: traceml_variant(s, variants) for s, *_ in cases}
    print(f"TraceML {version} from {site}; both tools on the same processes: TraceML's launcher "
          f"runs the ranks, megascope's tracer attaches to each\n", flush=True)  # fmt: skip
    results: list[Verdicts] = []
    t0 = time.monotonic()
    for n, (script, slow, factor, rep) in enumerate(cases, 1):
        run = os.path.join(base, run_name(script.name, slow, factor, rep))
        shutil.rmtree(run, ignore_errors=True)
        os.makedirs(run)
        res = Verdicts(script.name, slow, factor, rep, ok=False)
        done = run_both(script, scripts[script.name], shim, site, run, slow, factor, args.steps,
                        args.timeout)  # fmt: skip
        tml = traceml_verdict(run) if done else None
        if tml and os.path.exists(os.path.join(run, "megascope", "run.json")):
            res.ok = True
            res.traceml, res.traceml_ranks = tml
            res.megascope, res.megascope_ranks, res.megascope_alarms = megascope_verdict(run)
        results.append(res)
        said = (f"TraceML {res.traceml} {shown(res.traceml_ranks, slow)}; megascope "
                f"{res.megascope}" if res.ok else "did not finish")  # fmt: skip
        print(f"[{n}/{len(cases)} {time.monotonic() - t0:.0f}s] {script.name} rank {slow} "
              f"{factor}x: {said}", flush=True)  # fmt: skip
        with open(os.path.join(base, "results.json"), "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    print(f"\n{len(cases)} runs, {args.steps} steps each, {time.monotonic() - t0:.0f} s\n")
    side_by_side(results)
    print()
    summarize(results)
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
