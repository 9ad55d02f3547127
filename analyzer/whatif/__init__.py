"""What-if analysis: replay a run's steps on their dependency graph with typical durations.

from analyzer.whatif import analyze_whatif, prepare
report = analyze_whatif("RUN")            # the dict `megascope whatif --json` prints
w = prepare("RUN")                        # for other analyses built on the engine:
t_ideal = w.ideal()                       #   step times, every op at its typical duration
t = w.replay(keep=w.coords["rank"] == 5)  #   ... with rank 5 at its measured durations
"""

from analyzer.whatif.analysis import WhatIf, analyze_whatif, prepare
from analyzer.whatif.load import WhatIfError

__all__ = ["WhatIf", "WhatIfError", "analyze_whatif", "prepare"]
