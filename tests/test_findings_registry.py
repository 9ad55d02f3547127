"""The detector registry (analyzer/findings/registry.py): every detector module is in it, and
what the analyzer once listed by hand (the kinds, the persistent ones, the windows' measures,
the fleet's culprits, a regression's explanations) reads the same from the declarations."""

from __future__ import annotations

import importlib
import pkgutil

import analyzer.findings as findings_pkg
from analyzer import fleet, windows
from analyzer.findings import FINDING_KINDS, registry
from analyzer.findings.detector import DetectorSpec, unpriced


def test_every_detector_module_declares_itself_and_is_registered():
    registered = {id(d) for d in registry.DETECTORS}
    modules = []
    for info in pkgutil.iter_modules(findings_pkg.__path__):
        mod = importlib.import_module(f"analyzer.findings.{info.name}")
        if callable(getattr(mod, "detect", None)):
            modules.append(info.name)
            spec = getattr(mod, "DETECTOR", None)
            assert isinstance(spec, DetectorSpec), f"{info.name}: no DETECTOR"
            assert id(spec) in registered, f"{info.name}: not in registry.DETECTORS"
            assert spec.detect is mod.detect
    assert len(modules) == len(registry.DETECTORS)


def test_each_kind_is_declared_once():
    names = [k.name for d in registry.DETECTORS for k in d.kinds]
    assert len(names) == len(set(names))
    assert set(names) == set(FINDING_KINDS)


def test_the_lists_derive_from_the_declarations():
    # what analyzer/findings/__init__.py, common.py, windows.py, fleet.py and regression.py
    # listed by hand before the registry
    assert set(FINDING_KINDS) == {
        "straggler", "slow_link", "hang", "crash", "data_stall", "transient_stall",
        "stage_imbalance", "load_imbalance", "throttle", "regression", "checkpoint_stall",
        "hardware_imbalance", "offload_stall",
    }  # fmt: skip
    assert registry.PERSISTENT == ("straggler", "data_stall")
    assert windows.MEASURE == {"straggler": "work_ns", "data_stall": "data_ns"}
    assert set(fleet.CULPRIT_KINDS) == {"straggler", "hang", "crash", "throttle", "data_stall"}
    assert set(registry.EXPLAINING) == {"straggler", "data_stall", "load_imbalance"}
    priced = {k.name for k in registry.KINDS.values() if k.fix is not unpriced}
    assert priced == {"straggler", "load_imbalance", "slow_link", "stage_imbalance",
                      "hardware_imbalance"}  # fmt: skip


def test_the_persistent_detectors_run_again_from_an_onset():
    assert [d.name for d in registry.emitting(registry.PERSISTENT)] == ["straggler", "data_stall"]
