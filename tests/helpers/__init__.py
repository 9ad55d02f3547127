"""The test suite's one set of helpers; no test module imports another's names.

- :mod:`helpers.tiers`: the two tiers' rule: the fixtures and command lines that start ranks,
  and the guard that fails a test outside the live tier when it starts them.
- :mod:`helpers.paths`: where the repository, the examples, the test data and scripts are.
- :mod:`helpers.cli`: ``megascope VERB ...`` in a subprocess, and the one-line-error check.
- :mod:`helpers.live`: what starts ranks (``megascope train``, a script under torchrun with the
  tracer attached, gloo process groups, the browser). Tests reach these only through the
  fixtures of ``tests/conftest.py``, which mark them ``live``.
- :mod:`helpers.tables`: a run's Parquet rows read back with DuckDB, as the analyzer does.
- :mod:`helpers.world`, :mod:`helpers.small_run`: small simulated runs written as the tracer
  writes them, for the analyzer and the dashboard; :mod:`helpers.synth`, seeded
  ``megascope synth`` runs written in this process.
- :mod:`helpers.report`: a run's diagnosis, and how a failing assertion shows it.
- :mod:`helpers.net`: a free loopback port (every server and process group a test starts
  listens on 127.0.0.1).
- :mod:`helpers.dash`: the dashboard's callbacks called through Dash's own HTTP routes, and the
  heatmap read from a page.
- Corpus builders: :mod:`helpers.kineto_corpus` (Kineto traces in users' shapes),
  :mod:`helpers.nccl_fr`, :mod:`helpers.fr_truth`, :mod:`helpers.fr_own_sets` (NCCL-shaped
  Flight Recorder sets) and :mod:`helpers.fr_cases` (gloo Flight Recorder sets, live).

Scripts that the tests launch by path live in ``tests/scripts``.
"""
