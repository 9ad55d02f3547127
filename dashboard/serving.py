"""Start ``megascope dashboard`` in a child process on a free loopback port, for the scripts
and tests that drive it through Debian's headless Chromium (never a downloaded browser)."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

from tracer.loopback import free_port

CHROMIUM = "/usr/bin/chromium"
# Flags that work headless as root on a machine with no network but loopback.
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def start(run: str, *, timeout: float = 60.0) -> tuple[subprocess.Popen, str]:
    """Serve ``run`` and return the server process and its URL once the page answers.

    Raises RuntimeError with the server's stderr when it exits or does not answer in time.
    """
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "analyzer", "dashboard", run, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                assert proc.stderr is not None  # opened with stderr=PIPE
                raise RuntimeError(f"the dashboard did not start: {proc.stderr.read()}") from None
            time.sleep(0.3)
