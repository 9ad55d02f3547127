"""The app factory: ``create_app(run_or_root)`` returns a Dash app serving one run or a
folder of runs. Nothing is read at import time; the run is opened on the first request."""

from __future__ import annotations

import dash

from dashboard.callbacks import register
from dashboard.fleet_page import register_fleet
from dashboard.layout import page
from dashboard.runs import RunRegistry


def create_app(run_or_root: str) -> dash.Dash:
    """A Dash app for a run directory or a folder of run directories.

    Raises :class:`dashboard.runs.RunPathError` (one line) when the path is neither.
    """
    registry = RunRegistry(run_or_root)
    # Dash documents update_title=None (keep the tab's title while callbacks run) but
    # annotates the parameter as plain str.
    app = dash.Dash(
        __name__,
        title="megascope",
        update_title=None,  # type: ignore[arg-type]
        suppress_callback_exceptions=True,
    )
    app.layout = lambda: page(registry.names() or ["."])  # re-listed on every page load
    register(app, registry)
    register_fleet(app, registry)  # /fleet: the runs table and each host's history
    app.server.config["MEGASCOPE_REGISTRY"] = registry
    return app
