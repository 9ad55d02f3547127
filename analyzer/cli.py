"""The ``megascope`` command: dispatches each verb to the part that owns it.

Each verb's module is imported only when that verb runs, so ``megascope analyze`` never
imports torch and ``megascope --help`` is instant. Every module exposes ``main(argv) -> int``.
"""

from __future__ import annotations

import importlib
import sys

from tracer.cliutil import UsageError, fail

# verb -> (module, one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "train": ("trainer.launch", "train the parallel GPT with torchrun (faults on request)"),
    "analyze": ("analyzer.commands.analyze", "name the straggler, slow link, hang, crash"),
    "sql": ("analyzer.commands.sql", "run a SQL query over a run's views"),
    "dashboard": ("dashboard.cli", "serve the web dashboard for a run or a folder of runs"),
    "demo": (
        "analyzer.commands.demo",
        "a short CPU run with a known fault, its report, its dashboard",
    ),
    "import": (
        "analyzer.commands.importer",
        "import Kineto traces, Flight Recorder dumps or what-if traces",
    ),
    "export": ("analyzer.commands.export", "export a run as Chrome trace-event JSON (Perfetto)"),
    "synth": ("analyzer.commands.synth", "simulate a dp x pp x tp cluster and write its run"),
    "stacks": ("tracer.stacks", "ask a running traced job's ranks for their stacks"),
    "whatif": ("analyzer.commands.whatif", "replay the run ideal: the slowdown and who causes it"),
    "plan": ("analyzer.commands.plan", "rank every dp x tp x pp x cp layout of the run's ranks"),
    "compare": (
        "analyzer.commands.compare",
        "run against run: slower or not, where, and beyond the noise (exit 1 for CI)",
    ),
    "watch": (
        "analyzer.commands.watch",
        "follow a running run: findings as they appear and clear, Prometheus metrics",
    ),
    "compact": (
        "analyzer.commands.compact",
        "rewrite a finished run as a few large files per table",
    ),
    "fleet": (
        "analyzer.commands.fleet",
        "many runs: a table of them and the hosts and links that were culprits in several",
    ),
    "gather": (
        "analyzer.commands.gather",
        "merge the run directories of several nodes into one run",
    ),
}


def _usage() -> str:
    lines = ["usage: megascope VERB [args]", "", "verbs:"]
    lines += [f"  {verb:<10} {help_}" for verb, (_, help_) in VERBS.items()]
    lines += ["", "megascope VERB --help shows a verb's options; megascope --version, the version."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``megascope``: runs the verb ``argv[0]`` names with the rest; returns the exit
    status (2 with one line on a usage error, 130 on Ctrl-C)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] in ("-V", "--version"):
        from analyzer import __version__

        print(f"megascope {__version__}")
        return 0
    verb, rest = args[0], args[1:]
    if verb not in VERBS:
        fail(f"unknown verb {verb!r} (expected one of {', '.join(VERBS)})")
    module = importlib.import_module(VERBS[verb][0])
    try:
        return int(module.main(rest) or 0)
    except UsageError as e:
        fail(str(e))
    except KeyboardInterrupt:
        return 130
