"""``megascope analyze`` and ``megascope sql`` as a user runs them: through the command's own
dispatcher, exit codes and one-line errors (helpers/cli.py), and a fresh interpreter where the
process is the subject."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers.cli import megascope
from helpers.world import World, write_world

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def faulty(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("faulty"))
    write_world(World(slow_rank={5: 1.4}, seed=3), path)
    return path


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("healthy"))
    write_world(World(seed=4), path)
    return path


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megascope"), result.stderr
    return lines[0]


def test_bad_input_exits_2_with_one_line(tmp_path):
    assert "no such directory" in one_line_error(megascope("analyze", str(tmp_path / "missing")))
    assert "empty directory" in one_line_error(megascope("analyze", str(tmp_path)))
    (tmp_path / "run.json").write_text("{garbage")
    assert "not valid JSON" in one_line_error(megascope("analyze", str(tmp_path)))
    assert "not valid JSON" in one_line_error(megascope("sql", str(tmp_path), "select 1"))


def test_bad_flags_exit_2_with_one_line(faulty):
    one_line_error(megascope("analyze", faulty, "--steps", "9:3"))
    one_line_error(megascope("analyze", faulty, "--format", "pdf"))
    one_line_error(megascope("analyze", faulty, "--out", "/nonexistent-dir/r.json"))
    assert "SQL" in one_line_error(megascope("sql", faulty, "select * from no_such_view"))


def test_json_report_and_exit_codes(faulty, healthy):
    result = megascope("analyze", faulty, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["schema"] == "megascope.findings/1"
    assert [(f["kind"], f["ranks"]) for f in report["findings"]] == [("straggler", [5])]
    assert megascope("analyze", faulty, "--fail-on-findings").returncode == 3
    clean = megascope("analyze", healthy, "--fail-on-findings")
    assert clean.returncode == 0 and "no findings" in clean.stdout


def test_text_markdown_and_html_outputs(faulty, tmp_path):
    text = megascope("analyze", faulty)
    assert text.returncode == 0 and "straggler" in text.stdout and "rank 5" in text.stdout
    md = megascope("analyze", faulty, "--format", "markdown")
    assert md.stdout.startswith("# megascope findings") and "| 1 | straggler | 5 |" in md.stdout
    out = tmp_path / "report.html"
    html = megascope("analyze", faulty, "--out", str(out))
    assert html.returncode == 0 and html.stdout == ""
    page = out.read_text()
    assert page.startswith("<!doctype html>") and "straggler" in page
    assert page.count("Plotly.newPlot") == 3 and "<script src=" not in page  # self-contained
    js = tmp_path / "r.json"
    assert megascope("analyze", faulty, "--out", str(js)).returncode == 0
    assert json.loads(js.read_text())["findings"][0]["ranks"] == [5]


def test_corrupt_part_is_skipped_with_a_warning_and_the_answer_stands(faulty, tmp_path):
    import shutil

    run = str(tmp_path / "run")
    shutil.copytree(faulty, run)
    victim = os.path.join(run, "spans", "rank=00002", "part-000001.parquet")
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 3)
    result = megascope("analyze", run, "--json")
    assert result.returncode == 0
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "part-000001.parquet" in warnings[0]
    report = json.loads(result.stdout)
    assert [(f["kind"], f["ranks"]) for f in report["findings"]] == [("straggler", [5])]


def test_sql_prints_views_as_table_and_json(faulty):
    result = megascope(
        "sql", faulty, "select rank, count(*) as n from steps group by rank order by rank"
    )
    assert result.returncode == 0 and "rank" in result.stdout
    rows = json.loads(
        megascope(
            "sql",
            faulty,
            "select rank, count(*) as n from steps group by rank order by rank",
            "--json",
        ).stdout
    )
    assert rows == [{"rank": r, "n": 12} for r in range(8)]


def test_the_analyzer_never_imports_torch():
    code = (
        "import sys, analyzer.cli, analyzer.commands.analyze, analyzer.commands.sql, "
        "analyzer.db, analyzer.findings, analyzer.render.findings, analyzer.render.findings_html; "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr


def test_version_is_the_packages():
    from importlib.metadata import version

    import analyzer

    out = megascope("--version", check=True).stdout
    assert out == f"megascope {version('megascope')}\n" and analyzer.__version__ in out


def test_version_is_pyprojects():
    """The installed version is pyproject.toml's (one source; an install older than the tree
    would report the old one), and it is the latest release of CHANGELOG.md."""
    import re

    import analyzer

    with open(os.path.join(REPO, "pyproject.toml"), encoding="utf-8") as f:
        declared = re.search(r'^version = "([^"]+)"$', f.read(), re.M).group(1)
    with open(os.path.join(REPO, "CHANGELOG.md"), encoding="utf-8") as f:
        released = re.findall(r"^## \[(\d[^\]]*)\]", f.read(), re.M)
    assert analyzer.__version__ == declared == released[0]
