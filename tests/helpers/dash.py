"""The dashboard as the browser uses it: callbacks through Dash's own endpoint, figures' arrays
as the browser gets them, and the rank x step heatmap read from a page."""

from __future__ import annotations

import base64
import re

import numpy as np


def callback(client, output: str, inputs: list[tuple[str, str, object]], state=()) -> dict:
    """Call one callback through Dash's own endpoint, as the browser does."""

    def props(items):
        return [{"id": i, "property": p, "value": v} for i, p, v in items]

    specs = [o.rsplit(".", 1) for o in output.strip(".").split("...")]
    outputs = [{"id": i, "property": p} for i, p in specs]
    body = {
        "output": output,
        "outputs": outputs if len(outputs) > 1 else outputs[0],
        "inputs": props(inputs),
        "state": props(state),
        "changedPropIds": [f"{inputs[0][0]}.{inputs[0][1]}"],
    }
    resp = client.post("/_dash-update-component", json=body)
    assert resp.status_code == 200, resp.data[:300]
    return resp.get_json()["response"]


def array(value) -> np.ndarray:
    """A figure's array as the browser gets it: a list, or plotly's typed array (base64)."""
    if isinstance(value, dict) and "bdata" in value:
        out = np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"])
        shape = value.get("shape")
        if shape:
            out = out.reshape([int(n) for n in str(shape).split(",")])
        return out
    return np.asarray(value, dtype=float)


# The heatmap as drawn: its row labels, its columns (steps) and its values.
HEATMAP_DATA = """() => {
  const gd = document.querySelector('#heatmap .js-plotly-plot');
  const t = gd._fullData[0];
  return {y: Array.from(t.y), x: Array.from(t.x), z: Array.from(t.z, (r) => Array.from(r)),
          title: gd._fullLayout.title.text};
}"""


def darkest_rows(page) -> tuple[list[int], dict]:
    """Per step (column) of the page's heatmap, the rank of its highest cell (rows are one
    rank each on a small run, labelled ``host rN``); and the figure's data, with ``ranks``:
    each row's rank."""
    page.wait_for_selector("#heatmap .heatmaplayer")
    page.wait_for_function(
        "() => { const gd = document.querySelector('#heatmap .js-plotly-plot');"
        " return gd && gd._fullData && gd._fullData.length && gd._fullData[0].z; }"
    )
    data = page.evaluate(HEATMAP_DATA)
    ranks = data["ranks"] = [int(re.search(r"r(\d+)$", label).group(1)) for label in data["y"]]
    tops = []
    for col in range(len(data["x"])):
        values = [(v[col] if v[col] is not None else float("-inf")) for v in data["z"]]
        tops.append(ranks[max(range(len(values)), key=values.__getitem__)])
    return tops, data
