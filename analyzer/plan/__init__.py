"""Which layout should this job use: ``megascope plan RUN``, Galvatron's question on measured costs.

from analyzer.plan import plan_run, render
report = plan_run("RUN")              # the dict `megascope plan --json` prints
print(render(report))                 # the ranked table

A traced run gives the cost model (:mod:`analyzer.plan.fit`): compute per FLOP, collectives per
byte and group kind, the optimizer per parameter. Every layout of the run's ranks
(:mod:`analyzer.plan.layouts`) is built as the simulator's step graph and replayed by the
what-if engine; its memory per rank (:mod:`analyzer.plan.memory`) follows the trainer's own
accounting. :mod:`analyzer.plan.report` ranks them.
"""

from analyzer.plan.report import plan_run, render
from analyzer.plan.shape import PlanError

__all__ = ["PlanError", "plan_run", "render"]
