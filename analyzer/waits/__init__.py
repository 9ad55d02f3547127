"""The wait-for model of a run that stopped (a hang, a crash): who waits in what, for whom, and
who is at the root. Its pieces (model.py), the graph (graph.py) and its roots (roots.py); the
``hang`` and ``crash`` findings (analyzer/findings/hang.py) are built on it."""
