"""``analyzer_scale.py --shapes``: the whole report on several meshes of one world, side by side.

Each mesh is simulated three times (``megascope synth``, ``--detail`` fine by default, 8 microbatches, the
same number of rows per rank on every mesh): with one straggler, with one slow pipeline link,
and healthy. Each run is analyzed ``--repeat`` times by ``megascope analyze RUN --json``, each
time in a fresh process (a cold process, files in the page cache); the table shows the median
wall time of the whole command, the largest peak RSS, whether the injected culprit is the top
finding and the findings that name anything else (false alarms). The pandas column is the
straggler analysis of ``analyzer_scale.py`` written in pandas over the same files, once, on
the straggler runs.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "bench", ".data", "shapes")
SHAPES = ("dp=192,pp=8,tp=8", "dp=96,pp=16,tp=8", "dp=384,pp=4,tp=8", "dp=48,pp=32,tp=8",
          "dp=64,pp=8,tp=8,cp=3")  # fmt: skip
CASES = ("straggler", "link", "healthy")
STRAGGLER_FACTOR = 1.15
LINK_FACTOR = 1.5
TARGET_S, TARGET_GIB = 10.0, 2.0


def culprit(world: int) -> int:
    return world * 5 // 12 + 3  # an arbitrary rank in the middle of the world


def case_faults(mesh: dict[str, int], case: str) -> tuple[list[str], tuple[str, list[int]] | None]:
    """The faults injected for ``case`` and the finding expected first (kind, ranks)."""
    world = mesh["dp"] * mesh["pp"] * mesh["tp"] * mesh["cp"]
    r = culprit(world)
    if case == "straggler":
        return [f"slow_rank:rank={r},factor={STRAGGLER_FACTOR}"], ("straggler", [r])
    if case == "link":  # the pipeline link from the culprit's stage to the next, same place
        stage = world // mesh["pp"]
        a, b = sorted((r, r + stage if r + stage < world else r - stage))
        return [f"slow_link:ranks={a}-{b},factor={LINK_FACTOR}"], ("slow_link", [a, b])
    if case == "healthy":
        return [], None
    raise ValueError(f"unknown case {case!r}")


def judge(findings: list, expected: tuple[str, list[int]] | None) -> tuple[bool, list]:
    """(culprit named first, the findings that are not the injected fault)."""
    found = [(k, list(r)) for k, r, _ in findings]
    named = expected is None or (bool(found) and found[0] == (expected[0], expected[1]))
    others = [f for f in found if expected is None or f != (expected[0], expected[1])]
    return named, others


def _tag(mesh: str) -> str:
    return mesh.replace(",", "-").replace("=", "")


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def run_shapes(
    shapes: list[str], cases: list[str], args: Any, measure: Callable, ensure_run: Callable
) -> int:
    from analyzer.synth import parse_mesh

    rows = []
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.digests]
    for mesh_text in shapes:
        mesh = parse_mesh(mesh_text)
        for case, digests in [(c, d) for c in cases for d in modes]:
            specs, expected = case_faults(mesh, case)
            suffix = "" if args.layout == "ranks" else "-" + args.layout
            suffix += "" if args.detail == "fine" else "-" + args.detail
            out = os.path.join(args.data or DATA, f"{_tag(mesh_text)}-{args.steps}-{case}{suffix}")
            ensure_run(mesh_text, args.steps, out, specs, args.layout, args.detail)
            load0 = _load()
            runs = [measure("report", out, digests) for _ in range(max(1, args.repeat))]
            errors = [r["error"] for r in runs if "error" in r]
            walls = sorted(r["wall_s"] for r in runs)
            row = {
                "shape": mesh_text,
                "case": case,
                "digests": "on" if digests else "off",
                "walls": walls,
                "wall_s": statistics.median(walls),
                "peak_gib": max(r.get("peak_gib", float("nan")) for r in runs),
                "cpu_s": statistics.median(r.get("cpu_s", float("nan")) for r in runs),
                "load": f"{load0} → {_load()}",
                "error": errors[0] if errors else None,
            }
            named, others = judge(runs[-1].get("findings", []), expected)
            row.update(named=named and not errors, others=others, expected=expected)
            row["dismissed"] = expected is not None and [expected[0], expected[1]] in [
                list(d) for d in runs[-1].get("dismissed", [])
            ]
            row["severity"] = runs[-1].get("severity")
            if case == "straggler" and digests and not args.skip_pandas:
                p = measure("pandas", out)
                row["pandas"] = (p.get("straggler_s"), p.get("straggler_peak_gib"))
                row["pandas_top"] = (p.get("top") or [None])[0]
            rows.append(row)
            _print_row(row)
    _print_table(rows)
    judged = [r for r in rows if r["digests"] == "on"] or rows  # the target is with digests
    ok = all(
        r["wall_s"] <= TARGET_S and r["peak_gib"] <= TARGET_GIB and r["named"] and not r["others"]
        for r in judged
    )
    print(f"\ntarget (each <= {TARGET_S:.0f} s and <= {TARGET_GIB:.0f} GiB, culprit first, "
          f"no false alarm): {'met' if ok else 'NOT met'}")  # fmt: skip
    return 0


def _print_row(r: dict) -> None:
    walls = ", ".join(f"{w:.1f}" for w in r["walls"])
    print(
        f"{r['shape']} {r['case']} digests {r['digests']}: {r['wall_s']:.1f} s (runs {walls}), CPU {r['cpu_s']:.1f} s, "
        f"{r['peak_gib']:.2f} GiB, "
        f"named {r['named']}, others {r['others']}, load {r['load']}"
        + (f", ERROR {r['error']}" if r["error"] else ""),
        flush=True,
    )


def _print_table(rows: list[dict]) -> None:
    print(
        "\n| shape | case | digests | wall s (median; runs) | CPU s | peak GiB | culprit first | "
        "false alarms | pandas straggler s / GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        shape = r["shape"].replace("=", "").replace(",", " ")
        walls = ", ".join(f"{w:.1f}" for w in r["walls"])
        if r["expected"] is None:
            named = "—"
        else:
            word = "yes" if r["named"] else "dismissed" if r["dismissed"] else "NO"
            named = f"{word} ({r['expected'][0]} {r['expected'][1]})"
        alarms = ", ".join(f"{k} {v[:4]}" for k, v in r["others"]) or "none"
        pandas = "—"
        if "pandas" in r and r["pandas"][0] is not None:
            pandas = f"{r['pandas'][0]:.1f} / {r['pandas'][1]:.2f} (rank {r['pandas_top']})"
        print(
            f"| {shape} | {r['case']} | {r['digests']} | **{r['wall_s']:.1f}** ({walls}) | {r['cpu_s']:.1f} | "
            f"{r['peak_gib']:.2f} | "
            f"{named} | {alarms} | {pandas} |"
        )
