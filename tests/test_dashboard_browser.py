"""The dashboard in a real browser: Debian's headless Chromium driven by Playwright.

A run with a slow rank is synthesized, ``megascope dashboard`` serves it on a free loopback
port, and the test checks what a user sees: the page loads, the 3D scene renders (a WebGL
canvas with many colours), the analyzer's straggler is named in the findings panel, clicking
a rank (a real mouse click on a slab cell) and a finding's button show that rank's timeline,
the rank x step heatmap's highest row is the slow rank's, the what-if tab draws the slow worker's cell highest, and a full-page screenshot is far from
blank. Skips only when /usr/bin/chromium is absent (the ``browser`` fixture).
"""

from __future__ import annotations

import base64
import signal

import pytest
from helpers.cli import megascope

from dashboard import serving

SLOW = 5

# Counts the distinct colours of a PNG by drawing it on a 2D canvas in the page itself.
COUNT_COLOURS = """async (b64) => {
  const img = new Image();
  img.src = 'data:image/png;base64,' + b64;
  await img.decode();
  const c = document.createElement('canvas');
  c.width = img.width; c.height = img.height;
  const ctx = c.getContext('2d', {willReadFrequently: true});
  ctx.drawImage(img, 0, 0);
  const d = ctx.getImageData(0, 0, c.width, c.height).data;
  const seen = new Set();
  for (let i = 0; i < d.length; i += 4) seen.add((d[i] << 16) | (d[i+1] << 8) | d[i+2]);
  return seen.size;
}"""

# The page position of a slab cell: plotly's axis conversions plus the plot's offsets.
CELL_XY = """([col, row]) => {
  const gd = document.querySelector('#slab .js-plotly-plot');
  const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
  const box = gd.getBoundingClientRect();
  return [box.left + xa._offset + xa.l2p(col), box.top + ya._offset + ya.l2p(row)];
}"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    run = str(tmp_path_factory.mktemp("browser") / "slow5")
    megascope("synth", "--mesh", "dp=2,pp=2,tp=2", "--steps", "12", "--inject",
              f"slow_rank:rank={SLOW},factor=1.5", "--out", run, "--quiet", check=True)  # fmt: skip
    try:
        proc, url = serving.start(run)
    except RuntimeError as e:
        pytest.fail(str(e))
    yield url
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def page(served, browser):
    pg = browser.new_page(viewport={"width": 1400, "height": 1000})
    pg.set_default_timeout(60_000)
    pg.goto(served)
    yield pg
    pg.close()


def _colours(page, png: bytes) -> int:
    return page.evaluate(COUNT_COLOURS, base64.b64encode(png).decode())


def test_page_loads_and_the_3d_scene_renders(page):
    page.wait_for_selector("#run-info:has-text('8 ranks')")
    page.wait_for_selector("#topology .gl-container canvas")
    page.wait_for_function(
        "() => { const gd = document.querySelector('#topology .js-plotly-plot');"
        " return gd && gd.data && gd.data.length && (gd._fullData[0].x || []).length === 8; }"
    )
    page.wait_for_timeout(1500)  # let WebGL draw
    shot = page.locator("#topology").screenshot()
    assert _colours(page, shot) > 200, "the 3D view looks blank"


def test_the_straggler_is_named_in_the_findings_panel(page):
    finding = page.locator(".finding", has_text="straggler").first
    finding.wait_for()
    message = finding.locator(".finding-message").inner_text()
    assert f"rank {SLOW}" in message


def test_clicking_a_rank_shows_its_timeline(page):
    page.get_by_label("dp=").check()  # the dp=0 slab: rows pp, columns tp; rank 5 is pp1 tp1
    page.wait_for_selector("#slab-box[style*='block'] #slab .heatmaplayer")
    page.locator("#slab").scroll_into_view_if_needed()
    page.wait_for_timeout(1000)
    x, y = page.evaluate(CELL_XY, [1, 1])
    page.mouse.click(x, y)
    page.wait_for_selector("#rank-info .rank-line:has-text('rank 5 ')")
    timeline = page.locator("#timeline")
    timeline.locator("text=r5 dp0 pp1 tp1").first.wait_for()
    assert timeline.locator("text=r1 dp0 pp0 tp1").count() >= 1  # its pipeline peer too


def test_a_findings_button_selects_its_ranks(page):
    page.get_by_label("whole cube").check()
    page.locator("#tabs .tab", has_text="rank × step").click()
    page.locator(".finding", has_text="straggler").first.get_by_role("button").click()
    page.wait_for_selector("#rank-info .rank-line:has-text('findings: straggler')")
    page.locator("#timeline").locator("text=r5 dp0 pp1 tp1").first.wait_for()


def test_the_rank_step_heatmap_shows_the_slow_rank_darkest(page):
    from helpers.dash import darkest_rows

    page.locator("#tabs .tab", has_text="rank × step").click()
    tops, data = darkest_rows(page)
    assert "peers" in data["title"] and len(tops) == 12
    assert tops.count(SLOW) >= 0.8 * len(tops), tops


# The what-if heatmap as drawn: the (stage, dp) of its highest cell, and how many cells.
WHATIF_TOP = """() => {
  const gd = document.querySelector('#whatif .js-plotly-plot');
  const z = gd._fullData[0].z;
  let best = [-1, -1, -Infinity], n = 0;
  z.forEach((row, pp) => row.forEach((v, dp) => { n++; if (v > best[2]) best = [pp, dp, v]; }));
  return [best[0], best[1], best[2], n];
}"""


def test_whatif_tab_shows_the_slow_worker_highest(page):
    page.locator("#tabs .tab", has_text="what-if").click()
    page.wait_for_selector("#whatif-info:has-text('steps replayed')")
    page.wait_for_selector("#whatif .heatmaplayer")
    page.wait_for_selector("#whatif .barlayer .point")
    pp, dp, s, cells = page.evaluate(WHATIF_TOP)
    assert (pp, dp, cells) == (1, 0, 4) and s > 1.2  # rank 5 is dp0 pp1
    page.wait_for_timeout(500)
    assert _colours(page, page.locator("#whatif").screenshot()) > 100


def test_screenshot_is_not_blank(page, tmp_path):
    path = tmp_path / "page.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 20_000
    assert _colours(page, path.read_bytes()) > 500


def test_live_mode_follows_new_steps_without_a_reload(tmp_path, page):
    from helpers.small_run import write_small_run

    run = write_small_run(
        str(tmp_path / "live"), {"dp": 2, "pp": 2, "tp": 2}, steps=3, status="running"
    )
    proc, url = serving.start(run)
    try:
        live = page.context.browser.new_page()
        live.goto(url)
        live.wait_for_selector("#run-info:has-text('LIVE')")
        live.wait_for_selector("#steps [aria-label='Maximum'][aria-valuemax='2']")
        live.evaluate("window.__same_page = true")
        write_small_run(run, {"dp": 2, "pp": 2, "tp": 2}, steps=4, status="running", first_step=3)
        # the range follows the newest step: its end moves from step 2 to step 6
        live.wait_for_selector("#steps [aria-label='Maximum'][aria-valuenow='6']")
        assert live.evaluate("window.__same_page === true")  # no reload happened
        live.close()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
