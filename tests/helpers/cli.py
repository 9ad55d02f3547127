"""``megascope VERB ...`` as a user runs it: a fresh process, its output captured as text.

None of these starts ranks: ``megascope train`` and ``megascope demo`` are in
:mod:`helpers.live`.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

from helpers.paths import ROOT


def _env(env: dict[str, str] | None) -> dict[str, str] | None:
    return None if env is None else {**os.environ, **env}


def megascope(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300, check: bool = False
) -> subprocess.CompletedProcess:
    """Run ``megascope ARGS`` to its end; ``env`` adds to the environment; ``check`` asserts a
    zero exit status, with the end of stderr as the message."""
    proc = subprocess.run(
        [sys.executable, "-m", "analyzer", *args],
        cwd=ROOT,
        env=_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def megascope_popen(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``megascope ARGS`` (a server, a watch); stdout and stderr merged, as text."""
    return subprocess.Popen(
        [sys.executable, "-m", "analyzer", *args],
        cwd=ROOT,
        env=_env(env),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str, code: int = 2) -> str:
    """The command failed with ``code`` and said why in one line, no traceback; that line."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-4000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def run_main(*args: str) -> subprocess.CompletedProcess:
    """``megascope ARGS`` in this process, through the same dispatcher and one-line errors as
    the command line: its exit status and what it printed. For input refused before anything
    starts (outside the live tier, a command that would start ranks fails the test instead)."""
    from analyzer.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return subprocess.CompletedProcess(list(args), int(code or 0), out.getvalue(), err.getvalue())
