"""No function of the four packages passes 80 lines unless the line above its ``def`` says why
(``# long: ...``): a longer one does several jobs, split by job (docs/design.md). The walk is
scripts/long_functions.py's, which lists them; ruff's PLR0915 (pyproject.toml) bounds their
statements beside it."""

from __future__ import annotations

import os
import runpy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = runpy.run_path(os.path.join(ROOT, "scripts", "long_functions.py"))


def test_no_function_passes_80_lines_without_saying_why():
    found = SCRIPT["long_functions"](80)
    unsaid = [f"{f.path}:{f.line} {f.name} ({f.lines} lines)" for f in found if f.why is None]
    assert unsaid == [], "split it by job, or say why on the line above its def: # long: <why>"


def test_the_walk_sees_the_house_and_reads_the_comment(tmp_path):
    every = list(SCRIPT["functions"]())
    assert len(every) > 1000 and {f.path.split(os.sep)[0] for f in every} == {
        "tracer", "trainer", "analyzer", "dashboard",
    }  # fmt: skip
    (tmp_path / "pkg").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    told = body.replace("    ", "        ")
    (tmp_path / "pkg" / "mod.py").write_text(
        f"class A:\n    # long: one table, row by row\n    def told(self):\n{told}"
        f"\n\ndef untold():\n{body}\n\ndef short():\n    pass\n"
    )
    got = {f.name: (f.lines, f.why) for f in SCRIPT["functions"](str(tmp_path), ("pkg",))}
    assert got == {
        "pkg.mod.A.told": (81, "one table, row by row"),
        "pkg.mod.untold": (81, None),
        "pkg.mod.short": (2, None),
    }
