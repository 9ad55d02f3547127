"""Make PNG screenshots of the dashboard's main views into docs/img/.

    .venv/bin/python scripts/screenshots.py [--mesh dp=8,pp=4,tp=4] [--slow 37] [--out docs/img]

Synthesizes a run with a slow rank (``megascope synth``) in a temporary folder, serves it
with ``megascope dashboard`` on a free loopback port and drives Debian's headless Chromium
(Playwright, /usr/bin/chromium; no browser is downloaded) through the page: the 3D
topology with the findings, the rank x step heatmap, the timeline of the slow rank's
neighbourhood (reached by clicking the finding, or the rank's slab cell), links and GPU
telemetry.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile

from dashboard import serving

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _serve(run: str) -> tuple[subprocess.Popen, str]:
    try:
        return serving.start(run)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None


def _select_rank(page, slow: int, coords: dict[str, int]) -> None:
    """Select the slow rank: its finding's button if the analyzer named it, else its cell in
    the dp slab (a real click on the heatmap cell)."""
    button = page.locator(".finding", has_text=f"rank {slow}").get_by_role("button")
    if button.count():
        button.first.click()
        return
    page.get_by_label("dp=").check()
    page.wait_for_selector("#slab-box[style*='block'] #slab .heatmaplayer")
    page.locator("#slab").scroll_into_view_if_needed()
    page.wait_for_timeout(1000)
    x, y = page.evaluate(
        """([col, row, dp]) => {
            const gd = document.querySelector('#slab .js-plotly-plot');
            const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
            const b = gd.getBoundingClientRect();
            return [b.left + xa._offset + xa.l2p(col), b.top + ya._offset + ya.l2p(row)];
        }""",
        [coords["tp"], coords["pp"], coords["dp"]],
    )
    page.mouse.click(x, y)
    page.get_by_label("whole cube").check()


def shoot(url: str, out: str, slow: int, coords: dict[str, int]) -> list[str]:
    from playwright.sync_api import sync_playwright

    os.makedirs(out, exist_ok=True)
    written = []
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=serving.CHROMIUM, args=serving.CHROMIUM_ARGS, headless=True
        )
        page = browser.new_page(viewport={"width": 1500, "height": 1100}, device_scale_factor=1)
        page.set_default_timeout(90_000)
        page.goto(url)
        page.wait_for_selector("#topology .gl-container canvas")
        page.wait_for_selector("#findings > div")
        page.wait_for_timeout(3000)

        def grab(name: str, selector: str) -> None:
            path = os.path.join(out, name)
            page.locator(selector).screenshot(path=path)
            written.append(path)

        grab("topology-3d.png", "#topology")
        grab("findings.png", "#findings")
        page.locator("#heatmap .heatmaplayer").wait_for()
        page.wait_for_timeout(1000)
        grab("rank-step-heatmap.png", "#heatmap")
        _select_rank(page, slow, coords)
        page.locator("#timeline .barlayer").wait_for()
        page.wait_for_timeout(1500)
        grab("timeline.png", "#timeline")
        for tab, selector, name in (
            ("links", "#links", "links.png"),
            ("GPU telemetry", "#gpu", "gpu.png"),
        ):
            page.locator("#tabs .tab", has_text=tab).click()
            page.locator(f"{selector} .main-svg").first.wait_for()
            page.wait_for_timeout(1500)
            grab(name, selector)
        page.locator("#tabs .tab", has_text="rank × step").click()
        page.wait_for_timeout(1500)
        path = os.path.join(out, "page.png")
        page.screenshot(path=path, full_page=True)
        written.append(path)
        browser.close()
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", default="dp=8,pp=4,tp=4")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument(
        "--slow",
        type=int,
        default=34,
        help="the rank made slow (with dp=0: the slab clicked is dp=0)",
    )
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "img"))
    args = p.parse_args(argv)
    from tracer.rundir import coords_of

    mesh = {k: int(v) for k, v in (kv.split("=") for kv in args.mesh.split(","))}
    if coords_of(args.slow, mesh)["dp"] != 0:
        p.error(f"--slow {args.slow}: pick a rank with dp=0 (the slab clicked is dp=0)")
    with tempfile.TemporaryDirectory(prefix="megascope-shots-") as tmp:
        run = os.path.join(tmp, "slow-rank")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "analyzer",
                "synth",
                "--mesh",
                args.mesh,
                "--steps",
                str(args.steps),
                "--inject",
                f"slow_rank:rank={args.slow},factor=1.4",
                "--out",
                run,
                "--quiet",
            ],
            cwd=ROOT,
            check=True,
        )
        proc, url = _serve(run)
        try:
            for path in shoot(url, args.out, args.slow, coords_of(args.slow, mesh)):
                print(os.path.relpath(path, ROOT))
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
