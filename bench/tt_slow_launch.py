"""torchtitan's own loop with one rank's transformer blocks made slower, as a user would do it:
a launcher of their own around torchtitan's ``main()`` (``../shared/torchtitan/README.md``).

    torchrun --nproc-per-node 4 -m tracer.run bench/tt_slow_launch.py \\
        --slow-rank 2 --slow-factor 1.5 --slow-mode sleep \\
        --module tt_cpu_config --config llama3_debugmodel_cpu --training.steps 30

The torchtitan folder (``cpu_shim``, ``tt_cpu_config``) must be on ``PYTHONPATH``. This
launcher's own flags (``--slow-rank``, ``--slow-factor``, ``--slow-mode burn|sleep``) are taken
off the command line before torchtitan reads it. ``Trainer.__init__`` is wrapped: once the
original has built and sharded the model, the slow rank's transformer blocks
(``model.layers``) get examples/slowdown.py's hooks, which burn or sleep ``factor - 1`` times
each block's own forward and backward. Nothing of torchtitan is modified.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import cpu_shim  # noqa: E402,F401  (must precede any torchtitan import)


def _own_flags() -> argparse.Namespace:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-factor", type=float, default=1.5)
    p.add_argument("--slow-mode", choices=("burn", "sleep"), default="sleep")
    args, rest = p.parse_known_args(sys.argv[1:])
    sys.argv[1:] = rest
    return args


def _slow_trainer(args: argparse.Namespace) -> None:
    from slowdown import slow_down
    from torchtitan import trainer as tt_trainer

    rank = int(os.environ.get("RANK", "0"))
    if rank != args.slow_rank or args.slow_factor <= 1.0:
        return
    original = tt_trainer.Trainer.__init__

    def init(self, *a, **kw) -> None:
        original(self, *a, **kw)
        for part in self.model_parts:
            layers = getattr(part, "layers", None)
            blocks = list(layers.values()) if hasattr(layers, "values") else list(layers or [])
            slow_down(part, args.slow_factor, blocks=blocks or None, mode=args.slow_mode)

    tt_trainer.Trainer.__init__ = init


def main() -> None:
    """Take this launcher's flags, slow the rank, run torchtitan's own ``main()``."""
    _slow_trainer(_own_flags())
    from torchtitan.train import main as tt_main

    tt_main()


if __name__ == "__main__":
    main()
