"""Print docs/design.md's map of the house: every module of tracer/, trainer/, analyzer/ and
dashboard/ with its job, the first sentence of its docstring (docstring markup made markdown).

    .venv/bin/python scripts/module_map.py      # paste under "## The map" in docs/design.md
"""

from __future__ import annotations

import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("tracer", "trainer", "analyzer", "dashboard")


def job(path: str) -> str:
    if path.endswith("__main__.py"):
        return f"`python -m {path.split('/')[0]}`."
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    end = para.find(". ")
    line = para[: end + 1] if end > 0 else para
    line = re.sub(r":(?:mod|class|func|data|meth|attr):`~?([^`]+)`", r"`\1`", line)
    return line.replace("``", "`")


def main() -> None:
    for pkg in PACKAGES:
        print(f"\n### `{pkg}/`\n")
        files = sorted(glob.glob(os.path.join(ROOT, pkg, "**", "*.py"), recursive=True))
        for path in (os.path.relpath(f, ROOT) for f in files):
            print(f"- `{path}`: {job(path)}")


if __name__ == "__main__":
    main()
