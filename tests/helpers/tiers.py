"""The two tiers' rule: which fixtures start ranks, which command lines do, and the guard that
fails a test outside the live tier when it starts ranks anyway (tests/conftest.py installs it
and switches it per test)."""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess

LIVE_FIXTURES = frozenset(
    {"ranks", "train", "trained", "attach", "attach_popen", "launch", "fr_case", "browser"}
)
_LIVE_VERBS = ("train", "demo")


def runs_alone(markexpr: str) -> bool:
    """Whether ``-m markexpr`` can select a ``solo`` test, whose ranks must have the cores to
    themselves (no expression, ``live``, ``solo``, ``live and not gpu``): such a run takes one
    process; ``not live`` and ``live and not solo`` a worker per core."""
    words = markexpr.replace("(", " ").replace(")", " ").split()

    def named(mark: str) -> bool:
        return any(w == mark and words[i - 1 : i] != ["not"] for i, w in enumerate(words))

    solo_excluded = "solo" in words and not named("solo")
    return not words or named("solo") or (named("live") and not solo_excluded)


class StartsRanks(RuntimeError):
    """A test outside the live tier started ranks."""


class Guard:
    on = False  # True while a test outside the live tier sets up, runs or tears down

    @staticmethod
    def install() -> None:
        """Guard every process start of this interpreter (once, from tests/conftest.py)."""
        subprocess.Popen.__init__ = _guarded_popen_init  # type: ignore[method-assign]
        multiprocessing.process.BaseProcess.start = _guarded_start  # type: ignore[method-assign]

    @classmethod
    def check(cls, what: str) -> None:
        if cls.on:
            raise StartsRanks(
                f"this test starts ranks ({what}) but is not in the live tier: take them through "
                f"one of the fixtures {sorted(LIVE_FIXTURES)} (tests/conftest.py)"
            )


def starts_ranks(args: object) -> str | None:
    """What a command line that starts ranks starts (None for any other): torchrun, ``python
    -m torch.distributed.run``, ``python -m trainer``, ``megascope train`` or ``demo``, a
    browser (Chromium, or Playwright's driver, which starts one)."""
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)  # type: ignore[call-overload]
    words = [os.fsdecode(a) for a in argv]
    if not words:
        return None
    program = os.path.basename(words[0])
    if program == "torchrun" or program.startswith("chromium") or "playwright" in words[0]:
        return program
    for i, word in enumerate(words[1:], 1):
        verb = words[i + 1] if i + 1 < len(words) else ""
        if words[i - 1] == "-m" and (
            word in ("torch.distributed.run", "trainer")
            or (word == "analyzer" and verb in _LIVE_VERBS)
        ):
            return " ".join(words[i - 1 : i + 2])
    return None


_popen_init = subprocess.Popen.__init__
_process_start = multiprocessing.process.BaseProcess.start


def _guarded_popen_init(self, args, *rest, **kwargs):  # type: ignore[no-untyped-def]
    if Guard.on:
        what = starts_ranks(args)
        if what:
            Guard.check(what)
    return _popen_init(self, args, *rest, **kwargs)


def _guarded_start(self):  # type: ignore[no-untyped-def]
    # ranks in processes of this interpreter: helpers.ranks' workers or torch's spawn (a
    # library's own pool, such as the Kineto importer's, is not a rank)
    module = getattr(getattr(self, "_target", None), "__module__", "") or ""
    if module.startswith(("helpers.", "torch.multiprocessing")):
        Guard.check(f"a process running {module}")
    return _process_start(self)
