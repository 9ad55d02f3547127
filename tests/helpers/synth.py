"""Seeded simulated runs written in this process (``megascope synth``'s library call)."""

from __future__ import annotations

from analyzer.synth import SynthConfig, parse_injections, synthesize


def synth_run(
    path: str,
    *specs: str,
    mesh: dict[str, int],
    steps: int = 10,
    seed: int = 0,
    layout: str = "ranks",
    **kw,
) -> str:
    """Simulate ``mesh`` with the faults ``specs`` (SPEC §5) into ``path``; the run directory.
    ``kw`` are the rest of :class:`analyzer.synth.SynthConfig` (extras, experts, ...)."""
    world = mesh["dp"] * mesh["pp"] * mesh["tp"] * mesh.get("cp", 1)
    cfg = SynthConfig(
        mesh=dict(mesh),
        steps=steps,
        microbatches=4,
        faults=parse_injections(list(specs), world),
        seed=seed,
        **kw,
    )
    synthesize(cfg, str(path), list(specs), layout=layout)
    return str(path)
