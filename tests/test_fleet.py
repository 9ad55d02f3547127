"""megascope fleet over synth jobs that share a cluster's hosts (synth --hosts).

Six jobs of 16 ranks (two hosts each) are placed on a pool of four hosts; host h3 holds a slow
rank in three of them and h1 one in a fourth: fleet names h3 alone, with its three runs. An
unreadable run is one line and skipped.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from helpers import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = "dp=2,pp=2,tp=4"
# job -> (hosts, slow rank or None): ranks 0-7 on the first host, 8-15 on the second
JOBS = {
    "j1": ("h0,h3", 9),
    "j2": ("h3,h1", 2),
    "j3": ("h2,h3", 12),
    "j4": ("h0,h1", None),
    "j5": ("h1,h2", 3),
    "j6": ("h2,h0", None),
}


def megascope(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """The command line on raw rows (helpers/cli.py), checked unless ``check`` is False."""
    return cli.megascope(*args, env={"MEGASCOPE_DIGESTS": "raw"}, check=check)


@pytest.fixture(scope="module")
def cluster_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    for seed, (job, (hosts, slow)) in enumerate(JOBS.items()):
        fault = ["--inject", f"slow_rank:rank={slow},factor=1.5"] if slow is not None else []
        megascope("synth", "--mesh", MESH, "--steps", "12", "--hosts", hosts, "--seed",
                  str(seed), "--out", str(root / job), "--quiet", *fault)  # fmt: skip
    return root


def test_synth_places_ranks_on_the_hosts_named(cluster_root, tmp_path):
    out = megascope("sql", str(cluster_root / "j2"), "select rank, host from topology order by rank",
                    "--json").stdout  # fmt: skip
    hosts = [r["host"] for r in json.loads(out)]
    assert hosts == ["h3"] * 8 + ["h1"] * 8
    (tmp_path / "hosts.txt").write_text("a b  # two\nc\n")
    megascope("synth", "--mesh", "dp=3,pp=1,tp=8", "--steps", "3", "--hosts",
              f"@{tmp_path / 'hosts.txt'}", "--out", str(tmp_path / "r"), "--quiet")  # fmt: skip
    out = megascope("sql", str(tmp_path / "r"), "select distinct host from topology order by 1",
                    "--json").stdout  # fmt: skip
    assert [r["host"] for r in json.loads(out)] == ["a", "b", "c"]
    for bad in ("h1", "h1,h1", "@" + str(tmp_path / "missing")):
        p = megascope("synth", "--mesh", MESH, "--steps", "3", "--hosts", bad,
                      "--out", str(tmp_path / "x"), check=False)  # fmt: skip
        assert p.returncode == 2 and p.stderr.count("\n") == 1, (bad, p.stderr)


def test_fleet_names_the_repeat_culprit_host_alone(cluster_root, tmp_path):
    bad = cluster_root / "broken"
    bad.mkdir(exist_ok=True)
    (bad / "run.json").write_text("{")
    out = tmp_path / "fleet.json"
    p = megascope("fleet", str(cluster_root), "--json", "--out", str(out), "--no-whatif")
    report = json.loads(p.stdout)
    assert json.loads(out.read_text()) == report
    assert sorted(r["job"] for r in report["runs"]) == [f"synth-16r-12s-seed{i}" for i in range(6)]
    assert [e["host"] for e in report["repeat_culprits"]] == ["h3"]
    h3 = report["repeat_culprits"][0]
    assert sorted(h3["paths"]) == [str(cluster_root / j) for j in ("j1", "j2", "j3")]
    assert h3["kinds"] == ["straggler"] and len(h3["runs"]) == 3
    assert report["repeat_links"] == []
    assert [s["run"] for s in report["skipped"]] == [str(bad)]
    assert p.stderr.count("broken") == 1 and "Traceback" not in p.stderr
    text = megascope("fleet", str(cluster_root / "j1"), str(cluster_root / "j4"), "--no-whatif")
    assert "straggler 9 on h3" in text.stdout and "repeat culprits (hosts): none" in text.stdout
    none = megascope("fleet", str(bad), check=False)
    assert none.returncode == 2 and "Traceback" not in none.stderr


def test_fleet_reads_a_run_through_a_pyarrow_url(cluster_root):
    url = "file://" + str(cluster_root / "j1")
    report = json.loads(megascope("fleet", url, "--json", "--no-whatif").stdout)
    assert [r["run"] for r in report["runs"]] == [url]
    assert [f["hosts"] for f in report["runs"][0]["findings"]] == [["h3"]]


def test_dashboard_fleet_page_shows_runs_and_each_hosts_history(cluster_root):
    from dashboard.app import create_app

    client = create_app(str(cluster_root)).server.test_client()
    page = client.get("/fleet").get_data(as_text=True)
    assert page.count("<tr>") + page.count("<tr class='hot'>") == 6 + 1 + 4 + 1
    assert "culprit in more than one run: h3 (3 runs: straggler)" in page
    assert page.count("<tr class='hot'><td>h3</td>") == 1
    assert "<tr><td>h0</td><td>synth-16r-12s-seed0, synth-16r-12s-seed3, " in page
