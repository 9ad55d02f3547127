"""The 3D view as it opens in a real browser shows the culprit: its default colour is the
finding's own measure (own time over stage peers), so the rank the analyzer names is the
darkest cell, on the demo's own run (the session's ``demo`` fixture: 8 CPU ranks, dp2 x pp2 x
tp2, rank 5 at 2x, whose compute time reads a peer darker) and on a 12,288-rank simulated run
with one straggler. The colours are read from the plotly figure in the page
(``_fullData[0].marker.color`` against ``customdata``), not from pixels. Skips only when
/usr/bin/chromium is absent.
"""

from __future__ import annotations

import re
import signal

import pytest
from helpers.synth import synth_run

from analyzer.commands.demo import DEMO_FAULT
from dashboard import serving

SLOW = int(re.search(r"rank=(\d+)", DEMO_FAULT).group(1))
BIG = {"dp": 192, "pp": 8, "tp": 8, "cp": 1}  # 12,288 ranks
BIG_SLOW = 5123

# The 3D view's cells as drawn: each one's rank, its colour value, and the colour bar's title.
CUBE = """() => {
  const gd = document.querySelector('#topology .js-plotly-plot');
  const t = gd._fullData[0];
  return {ranks: Array.from(t.customdata, Number), values: Array.from(t.marker.color, Number),
          title: gd._fullData[0].marker.colorbar.title.text};
}"""


def opening_colours(browser, run: str, ranks: int) -> dict:
    """The 3D view's cells as the page opens on ``run`` (nothing chosen by the user)."""
    proc, url = serving.start(run)
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(180_000)
        page.goto(url)
        page.wait_for_selector(f"#run-info:has-text('{ranks} ranks')")
        page.wait_for_function(
            "(n) => { const gd = document.querySelector('#topology .js-plotly-plot');"
            " return gd && gd._fullData && gd._fullData.length"
            " && (gd._fullData[0].customdata || []).length === n; }",
            arg=ranks,
        )
        got = page.evaluate(CUBE)
        page.close()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    return got


def _darkest(got: dict) -> int:
    pairs = [(v, r) for r, v in zip(got["ranks"], got["values"], strict=True) if v == v]
    return max(pairs)[1]


@pytest.mark.live
@pytest.mark.solo
def test_the_demo_opens_with_its_slow_rank_the_darkest_cell(demo, browser):
    assert demo.returncode == 0, demo.stderr[-2000:]
    got = opening_colours(browser, demo.run, 8)
    assert "peers" in got["title"], got["title"]
    assert _darkest(got) == SLOW, got


@pytest.mark.live
def test_a_12288_rank_run_opens_with_its_straggler_the_darkest_cell(tmp_path, browser):
    run = synth_run(str(tmp_path / "big"), f"slow_rank:rank={BIG_SLOW},factor=1.5", mesh=BIG,
                    steps=6, detail="coarse")  # fmt: skip
    got = opening_colours(browser, run, 12288)
    assert len(got["values"]) == 12288
    assert _darkest(got) == BIG_SLOW
