"""How fast the dashboard's figure callbacks answer on a 12,288-rank run.

    .venv/bin/python bench/dashboard_scale.py [--mesh dp=192,pp=8,tp=8] [--steps 20] [--run DIR]

Synthesizes the run with ``megascope synth`` under bench/.data/ (git-ignored) unless it is
there already, builds the app with ``create_app`` and calls the callbacks through Dash's own
HTTP endpoint (``/_dash-update-component``, Flask's test client: the full callback path,
JSON included, without a socket). Prints, for each view, the median of a few calls and the
size of the JSON sent to the browser, and side by side the per-rank query the 3D view runs
on the dashboard's rank x step cache against the same aggregate computed from the raw
spans on every call (the ratio is why the cache exists).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dashboard.app import create_app  # noqa: E402
from dashboard.views import step_bounds  # noqa: E402

DEFAULT_RUN = os.path.join(ROOT, "bench", ".data", "synth-12288")


def _synth(run: str, mesh: str, steps: int, slow: int) -> None:
    if os.path.isfile(os.path.join(run, "run.json")):
        return
    print(f"synthesizing {mesh} x {steps} steps into {run} ...", flush=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "analyzer",
            "synth",
            "--mesh",
            mesh,
            "--steps",
            str(steps),
            "--detail",
            "coarse",
            "--inject",
            f"slow_rank:rank={slow},factor=1.3",
            "--out",
            run,
            "--force",
        ],
        cwd=ROOT,
        check=True,
    )


def _inputs(names: list[tuple[str, str, Any]]) -> list[dict[str, Any]]:
    return [{"id": i, "property": p, "value": v} for i, p, v in names]


def _call(client: Any, output: str, inputs: list, state: list | None = None) -> tuple[float, int]:
    """One callback through Dash's endpoint: (seconds, bytes of JSON answered)."""
    specs = [o.rsplit(".", 1) for o in output.strip(".").split("...")]
    outputs = [{"id": i, "property": p} for i, p in specs]
    body = {
        "output": output,
        "outputs": outputs if len(outputs) > 1 else outputs[0],
        "inputs": _inputs(inputs),
        "state": _inputs(state or []),
        "changedPropIds": [f"{inputs[0][0]}.{inputs[0][1]}"],
    }
    t = time.perf_counter()
    resp = client.post("/_dash-update-component", json=body)
    took = time.perf_counter() - t
    if resp.status_code not in (200, 204):
        raise SystemExit(f"callback {output} answered {resp.status_code}: {resp.data[:300]!r}")
    return took, len(resp.data)


def _median(fn: Any, repeat: int) -> tuple[float, int]:
    runs = [fn() for _ in range(repeat)]
    return statistics.median(t for t, _ in runs), runs[-1][1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", default="dp=192,pp=8,tp=8")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--run", default=DEFAULT_RUN)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--slow", type=int, default=5000, help="the slow rank (and the one selected)")
    args = p.parse_args(argv)
    sizes = [int(kv.split("=")[1]) for kv in args.mesh.split(",")]
    slow = min(args.slow, int(np.prod(sizes)) // 2 + 1)
    _synth(args.run, args.mesh, args.steps, slow)

    t = time.perf_counter()
    app = create_app(args.run)
    client = app.server.test_client()
    src = app.server.config["MEGASCOPE_REGISTRY"].get(".")
    version = {"run": ".", "v": list(src.refresh())}
    build = time.perf_counter() - t
    first, last = step_bounds(src)
    world = len(src.topology())
    print(
        f"run: {world} ranks, steps {first}..{last}; open + build the rank x step cache "
        f"(once per data version): {build:.2f} s"
    )

    steps = [first, last]
    topo_in = [
        ("version", "data", version),
        ("metric", "value", "compute"),
        ("steps", "value", steps),
        ("slice-axis", "value", "none"),
        ("slice-index", "value", 0),
        ("cp", "value", -1),
        ("selected", "data", [slow]),
    ]
    views = {
        "3D topology (compute)": ("..topology.figure...slab.figure...slab-box.style..", topo_in),
        "3D topology, slab pp=3": (
            "..topology.figure...slab.figure...slab-box.style..",
            [
                *topo_in[:3],
                ("slice-axis", "value", "pp"),
                ("slice-index", "value", 3),
                *topo_in[5:],
            ],
        ),
        "rank x step heatmap": (
            "heatmap.figure",
            [("tabs", "value", "heatmap"), *topo_in[:3], ("selected", "data", [slow])],
        ),
        "timeline (slow rank)": (
            "timeline.figure",
            [
                ("tabs", "value", "timeline"),
                ("selected", "data", [slow]),
                ("timeline-step", "value", last),
                ("version", "data", version),
                ("steps", "value", steps),
            ],
        ),
        "links": (
            "links.figure",
            [("tabs", "value", "links"), ("version", "data", version), ("steps", "value", steps)],
        ),
    }
    _call(
        client,
        "..findings.children...finding-ranks.data..",
        [("version", "data", version), ("steps", "value", steps)],
    )  # analyze once, cached
    print(f"{'view':<28}{'median s':>10}{'JSON KiB':>10}")
    for name, (output, inputs) in views.items():
        took, size = _median(lambda o=output, i=inputs: _call(client, o, i), args.repeat)
        print(f"{name:<28}{took:>10.3f}{size / 1024:>10.0f}")

    cached = _median(
        lambda: (_timed(lambda: src.query("metric_compute", first=first, last=last)), 0),
        args.repeat,
    )[0]
    raw = _median(
        lambda: (
            _timed(
                lambda: src._run.con.execute(  # noqa: SLF001
                    "select rank, sum(end_ns - start_ns) / count(distinct step) / 1e6 "
                    "as value from spans where kind = 'compute' "
                    "and step between $first and $last group by rank",
                    {"first": first, "last": last},
                ).df()
            ),
            0,
        ),
        args.repeat,
    )[0]
    print(
        f"per-rank compute query: cache {cached:.3f} s vs raw spans {raw:.3f} s "
        f"(x{raw / cached:.0f})"
    )
    print(json.dumps({"ranks": world, "build_s": round(build, 2)}))
    return 0


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    raise SystemExit(main())
