"""``megascope VERB ...`` as a user runs it, its output captured as text: in this process, or
in a fresh one where the process itself is the subject.

None of these starts ranks: ``megascope train`` and ``megascope demo`` are in
:mod:`helpers.live`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
import traceback
from collections.abc import Iterator

from helpers.paths import ROOT
from helpers.tiers import StartsRanks


def _env(env: dict[str, str] | None) -> dict[str, str] | None:
    return None if env is None else {**os.environ, **env}


def megascope(
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    check: bool = False,
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``megascope ARGS`` to its end, its output captured; ``env`` adds to the environment;
    ``check`` asserts a zero exit status, with the end of stderr as the message.

    In this process by default (:func:`run_main`: the same dispatcher, one-line errors and exit
    codes, without an interpreter's start, which is most of a short command's time); with
    ``fresh``, a new interpreter, for the tests whose subject is the process itself (a fresh
    import, a signal, an exit status set by the interpreter). ``timeout`` bounds a fresh
    process only (pytest-timeout bounds the test)."""
    if fresh:
        proc = subprocess.run(
            [sys.executable, "-m", "analyzer", *args],
            cwd=ROOT,
            env=_env(env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    else:
        proc = run_main(*args, env=env)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@contextlib.contextmanager
def _as_a_process(env: dict[str, str] | None) -> Iterator[None]:
    """What a fresh process of the command would have, restored after: ``os.environ`` with
    ``env`` added, the repository's root as the working directory, and logging not yet set up
    (so that the command's own ``basicConfig`` writes to the stderr captured now, not to the
    first one captured, nor into pytest's handlers)."""
    saved_env, cwd = dict(os.environ), os.getcwd()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    os.environ.update(env or {})
    os.chdir(ROOT)
    root.handlers = []
    try:
        yield
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers, root.level = handlers, level
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved_env)


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


def run_main(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``megascope ARGS`` in this process, through the same dispatcher and one-line errors as
    the command line, from the repository's root with ``env`` added: its exit status and what
    it printed. An exception the command let through reads as it would from a fresh process:
    its traceback on stderr and exit status 1. Outside the live tier, a command that would
    start ranks fails the test instead."""
    from analyzer.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _as_a_process(env):
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except StartsRanks:
            raise
        except Exception:
            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess(list(args), int(code or 0), out.getvalue(), err.getvalue())
