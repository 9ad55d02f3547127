"""The cluster simulator behind ``megascope synth``.

A model of a dp x pp x tp (x cp) cluster training a GPT with a 1F1B pipeline,
tensor/sequence-parallel collectives, context-parallel collectives and a sharded optimizer,
with every fault of the SPEC's injection language. Its step is a dependency graph built from
the schedule (:mod:`analyzer.synth.stepgraph`) and timed by the what-if's replay engine
(:mod:`analyzer.whatif.replay`) with generated durations (:mod:`analyzer.synth.durations`).
It writes an ordinary run directory, so the analyzer, the dashboard and the benchmarks read it
exactly like a real run.

    from analyzer.synth import SynthConfig, synthesize
    meta = synthesize(SynthConfig(mesh={"dp": 2, "pp": 2, "tp": 2, "cp": 1}, steps=20,
                                  microbatches=4), "RUN")
"""

from analyzer.synth.config import (
    Extras,
    HwClassRange,
    ModelShape,
    SynthConfig,
    SynthError,
    parse_hosts,
    parse_hw_classes,
    parse_imbalance,
    parse_injections,
    parse_mesh,
    parse_throttle,
)
from analyzer.synth.run import synthesize

__all__ = [
    "Extras",
    "HwClassRange",
    "ModelShape",
    "SynthConfig",
    "SynthError",
    "parse_imbalance",
    "parse_injections",
    "parse_hosts",
    "parse_hw_classes",
    "parse_mesh",
    "parse_throttle",
    "synthesize",
]
