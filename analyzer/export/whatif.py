"""``megascope export whatif RUN --out DIR``: a run in the trace schema of the what-if study.

Writes ``DIR/trace.parquet`` and ``DIR/meta.yaml`` in the schema that
:mod:`analyzer.importers.whatif` reads (ByteDance Seed's straggler study, OSDI 2025), so that a
megascope run, real or simulated, is analyzed like the study's own traces (and by tools made
for them). One row per operation of a step on a rank:

* ``rank`` (global), ``dp_rank`` (``dp``, or ``dp * cp + cp`` when cp > 1: the study's dp x dsp
  with dsp innermost), ``stage`` (``pp``), ``step``;
* ``optype``: ``forward-compute`` / ``backward-compute`` (spans ``forward`` / ``backward``),
  ``optimizer``, ``gc``; ``forward-send`` / ``forward-recv`` / ``backward-send`` /
  ``backward-recv`` (pipeline send/recv: a send from stage s to s + 1 carries activations,
  to s - 1 gradients, and with model chunks the last stage sends on to the first; where both
  directions join the same two stages, pp 2 with model chunks, the direction is that of the
  sender's last compute before the send, and the receive takes its send's);
  ``grads-reduce-scatter`` / ``params-all-gather`` / ``separate-grads-all-reduce`` (dp
  reduce_scatter / all_gather / all_reduce), ``layernorm-grads-all-reduce`` (a tp collective
  outside the forward and backward), ``embedding-grads-all-reduce`` (a pp all_reduce at pp 2:
  the first and the last stage), ``optimizer-clip-main-grad`` (an all_reduce over the world);
* ``start_ts`` (seconds after the step's first arrival on any rank; a collective's arrival as
  the what-if reads it, view ``whatif_ops``) and ``duration`` (end - start_ts);
* ``seq_id`` (order of the rank's ops of that optype in the step), ``mb_id`` (microbatch,
  compute only, else -1), ``mc`` (model chunk of a compute op: the k-th forward of a microbatch
  on a rank is chunk k, its backwards run the chunks in reverse; 0 for dp gradient and
  parameter collectives, else -1) and ``gmc`` (``mc * pp + stage``, compute only, else -1).

``meta.yaml``: ``trial_name`` (the run id), ``run_id`` 0, ``dp_size``, ``dsp_size`` (the
mesh's cp), ``pp_size``, ``tp_size``, ``vpp_size`` (run.json ``model.config.vpp``, or an
imported trace's ``import.vpp_size``; else 1), ``world_size``.

The schema has no row for a collective inside a forward or backward (a tensor- or
context-parallel one): the study counts it in the compute, so it is left out and its time
stays in the compute span; a tensor-parallel group then reads as one worker, the way the study
traces record it (``one_per_tp_group``: only tp rank 0 of each group, as the study's traces of
tp > 1 jobs do). Spans the schema has no optype for (``data``, a user's own) and collectives it
has no optype for (cp gradients, a pp all_reduce over more than two stages, other groups) are
left out and counted in the returned stats, as are unfinished rows.
"""

from __future__ import annotations

import os
from typing import Any

import duckdb
import numpy as np
import pandas as pd

from analyzer.duck import sql_text
from tracer.rundir import MeshError, coords_of, mesh_sizes

EPS_NS = 1_000  # a send posted this close before its compute's recorded end still follows it

SPAN_OPTYPE = {
    "forward": "forward-compute",
    "backward": "backward-compute",
    "optimizer": "optimizer",
    "gc": "gc",
}
COLL_OPTYPE = {  # (group, op) -> optype
    ("dp", "reduce_scatter"): "grads-reduce-scatter",
    ("dp", "all_gather"): "params-all-gather",
    ("dp", "all_reduce"): "separate-grads-all-reduce",
    ("tp", "all_reduce"): "layernorm-grads-all-reduce",
    ("tp", "all_gather"): "layernorm-grads-all-reduce",
    ("tp", "reduce_scatter"): "layernorm-grads-all-reduce",
    ("embedding", "all_reduce"): "embedding-grads-all-reduce",
    ("world", "all_reduce"): "optimizer-clip-main-grad",
}
COLUMNS = ("dp_rank", "stage", "rank", "step", "optype", "start_ts", "duration", "seq_id",
           "mc", "mb_id", "gmc")  # fmt: skip


class ExportError(ValueError):
    """A run that cannot be exported (one line)."""


def _vpp(meta: dict) -> int:
    """Model chunks per stage, from run.json (1 when it does not say)."""
    for where in (
        ((meta.get("model") or {}).get("config") or {}).get("vpp"),
        (meta.get("import") or {}).get("vpp_size"),
    ):
        if isinstance(where, int) and where >= 1:
            return where
    return 1


def _read(run_dir: str) -> tuple[dict, pd.DataFrame, pd.DataFrame]:
    """run.json, and the run's finished spans and collective rows (export/whatif_spans.sql,
    export/whatif_collectives.sql: arrivals as the what-if's own view reads them), read once
    through the run reader."""
    from analyzer.whatif import WhatIfError
    from analyzer.whatif.load import add_ops_view, opened

    try:
        with opened(run_dir) as run:
            add_ops_view(run)
            spans, collectives = (
                run.execute(sql_text(f"export/{q}")) for q in ("whatif_spans", "whatif_collectives")
            )
            return run.meta, spans, collectives
    except duckdb.Error as e:
        raise ExportError(
            f"{run_dir}: unreadable tables ({str(e).strip().splitlines()[0]})"
        ) from None
    except WhatIfError as e:  # not a run (one line, from the reader)
        raise ExportError(str(e)) from None


def _coords(meta: dict, mesh: dict[str, int], world: int) -> np.ndarray:
    """(world, 4) array of each rank's [dp, pp, tp, cp] (run.json ``coords`` where given)."""
    table = meta.get("coords")
    out = np.zeros((world, 4), dtype=np.int64)
    for r in range(world):
        if isinstance(table, list) and r < len(table) and table[r]:
            out[r] = list(table[r])[:4] + [0] * (4 - len(table[r][:4]))
        else:
            c = coords_of(r, mesh)
            out[r] = [c["dp"], c["pp"], c["tp"], c["cp"]]
    return out


def _chunks(comp: pd.DataFrame, vpp: int) -> np.ndarray:
    """The model chunk of each forward/backward row: the k-th forward of a microbatch on a rank
    in a step is chunk k; its backwards go the other way (chunk vpp - 1 first)."""
    k = comp.sort_values("start_ns").groupby(["rank", "step", "name", "microbatch"]).cumcount()
    k = k.reindex(comp.index).to_numpy()
    mc = np.where(comp["name"].to_numpy() == "backward", vpp - 1 - k, k)
    return np.clip(mc, 0, vpp - 1)


def _inside_compute(coll: pd.DataFrame, comp: pd.DataFrame) -> np.ndarray:
    """Whether each collective lies within a forward or backward span of its rank and step."""
    if coll.empty or comp.empty:
        return np.zeros(len(coll), dtype=bool)
    left = coll[["rank", "step", "t0", "t1"]].reset_index().sort_values("t0")
    right = comp[["rank", "step", "start_ns", "end_ns"]].sort_values("start_ns")
    hit = pd.merge_asof(
        left, right, left_on="t0", right_on="start_ns", by=["rank", "step"], direction="backward"
    )
    inside = hit["end_ns"].notna() & (hit["t1"] <= hit["end_ns"])
    return pd.Series(inside.to_numpy(), index=hit["index"]).reindex(coll.index).to_numpy()


def _direction(p2p: pd.DataFrame, comp: pd.DataFrame, stage: np.ndarray, pp: int, vpp: int):
    """'forward' or 'backward' for each send/recv row (module docstring)."""
    peer_stage = stage[p2p["peer"].clip(0, len(stage) - 1).to_numpy()]
    own = stage[p2p["rank"].to_numpy()]
    is_send = (p2p["op"] == "send").to_numpy()
    src = np.where(is_send, own, peer_stage)
    dst = np.where(is_send, peer_stage, own)
    # forwards go up the stages (with model chunks also from the last stage to the first)
    fwd = dst == src + 1 if vpp == 1 else (dst - src) % pp == 1
    if not (pp == 2 and vpp > 1):
        return np.where(fwd, "forward", "backward")
    # pp 2 with model chunks: both directions join the two stages; ask the sender's last compute
    sends = p2p[is_send].reset_index().sort_values("t0")
    last = comp[["rank", "step", "end_ns", "name"]].sort_values("end_ns")
    sends["at"] = sends["t0"] + EPS_NS
    hit = pd.merge_asof(
        sends.sort_values("at"), last, left_on="at", right_on="end_ns", by=["rank", "step"],
        direction="backward",
    )  # fmt: skip
    kind = np.where(hit["name"].fillna("forward").to_numpy() == "backward", "backward", "forward")
    by_send = {
        (int(r), int(p), int(s)): k
        for r, p, s, k in zip(hit["rank"], hit["peer"], hit["seq"], kind, strict=True)
    }
    out = []
    for r, p, s, send, f in zip(p2p["rank"], p2p["peer"], p2p["seq"], is_send, fwd, strict=True):
        key = (int(r), int(p), int(s)) if send else (int(p), int(r), int(s))
        out.append(by_send.get(key, "forward" if f else "backward"))
    return np.array(out, dtype=object)


def build_trace(run_dir: str, one_per_tp_group: bool = False) -> tuple[pd.DataFrame, dict, dict]:
    """The trace rows, the meta file's sizes and the export's counts."""
    meta, spans, coll = _read(run_dir)
    mesh, world = _checked_mesh(run_dir, meta)
    pp, vpp, cp = mesh["pp"], _vpp(meta), mesh["cp"]
    where = _coords(meta, mesh, world)
    dp_rank = where[:, 0] * cp + where[:, 3] if cp > 1 else where[:, 0]
    stage = where[:, 1]
    _check_rows(run_dir, spans, coll, world)
    counts: dict[str, int] = {}
    kept = spans["name"].isin(list(SPAN_OPTYPE))
    counts["spans_left_out"] = int((~kept).sum())
    spans = spans[kept].copy()
    comp = spans[spans["name"].isin(["forward", "backward"])]
    s_rows = _span_rows(spans, comp, stage, pp, vpp)
    c_rows = pd.DataFrame(columns=list(s_rows.columns))
    if len(coll):
        c_rows = _collective_rows(coll, comp, stage, pp, vpp, counts)
    rows = pd.concat([s_rows, c_rows], ignore_index=True)
    if one_per_tp_group and mesh["tp"] > 1:
        keep = where[rows["rank"].to_numpy(), 2] == 0
        counts["rows_of_other_tp_ranks"] = int((~keep).sum())
        rows = rows[keep]
    trace = _trace_table(rows, dp_rank, stage)
    sizes = {
        "trial_name": str(meta.get("run_id") or os.path.basename(os.path.abspath(run_dir))),
        "run_id": 0,
        "dp_size": mesh["dp"],
        "dsp_size": cp,
        "pp_size": pp,
        "tp_size": mesh["tp"],
        "vpp_size": vpp,
        "world_size": world,
    }
    counts["rows"] = len(trace)
    counts["ranks"] = int(trace["rank"].nunique())
    counts["steps"] = int(trace["step"].nunique())
    return trace, sizes, counts


def _checked_mesh(run_dir: str, meta: dict) -> tuple[dict[str, int], int]:
    """The run's mesh and world size, refused (:class:`ExportError`) where the what-if schema
    cannot hold them: a mesh that is not dp x pp x tp x cp of the world."""
    try:
        mesh = mesh_sizes(meta.get("mesh") or {})
    except MeshError as e:
        raise ExportError(f"{run_dir}: {e}") from None
    world = int(meta.get("world_size") or 0)
    if mesh["dp"] * mesh["pp"] * mesh["tp"] * mesh["cp"] != world or world < 1:
        raise ExportError(
            f"{run_dir}: mesh {mesh} is not dp x pp x tp x cp of world_size {world}, which the "
            "what-if schema needs"
        )
    return mesh, world


def _check_rows(run_dir: str, spans: pd.DataFrame, coll: pd.DataFrame, world: int) -> None:
    """Refuse (:class:`ExportError`) a run without compute spans or with a rank outside the
    world."""
    if spans.empty or not spans["name"].isin(["forward", "backward"]).any():
        raise ExportError(f"{run_dir}: no finished forward or backward spans to export")
    for frame in (spans, coll):
        if len(frame) and (frame["rank"].max() >= world or frame["rank"].min() < 0):
            raise ExportError(f"{run_dir}: a rank outside the world of {world}")


def _span_rows(
    spans: pd.DataFrame, comp: pd.DataFrame, stage: np.ndarray, pp: int, vpp: int
) -> pd.DataFrame:
    """The kept spans as trace rows: their op type, model chunk and microbatch."""
    mc = np.full(len(spans), -1, dtype=np.int64)
    is_comp = spans["name"].isin(["forward", "backward"]).to_numpy()
    mc[is_comp] = _chunks(comp, vpp)
    st = stage[spans["rank"].to_numpy()]
    return pd.DataFrame({
        "rank": spans["rank"].to_numpy(), "step": spans["step"].to_numpy(),
        "optype": spans["name"].map(SPAN_OPTYPE).to_numpy(),
        "t0": spans["start_ns"].to_numpy(), "t1": spans["end_ns"].to_numpy(),
        "mc": mc, "mb_id": np.where(is_comp, spans["microbatch"].to_numpy(), -1),
        "gmc": np.where(is_comp, mc * pp + st, -1),
    })  # fmt: skip


def _collective_rows(
    coll: pd.DataFrame,
    comp: pd.DataFrame,
    stage: np.ndarray,
    pp: int,
    vpp: int,
    counts: dict[str, int],
) -> pd.DataFrame:
    """The collectives the schema names as trace rows (those inside a compute span, and those
    it has no op type for, counted in ``counts`` and left out)."""
    coll = coll.copy()
    coll["t1"] = np.maximum(coll["t1"].to_numpy(), coll["t0"].to_numpy())
    p2p = coll["op"].isin(["send", "recv"]).to_numpy() & (coll["peer"] >= 0).to_numpy()
    inside = _inside_compute(coll, comp) & ~p2p
    counts["collectives_in_compute"] = int(inside.sum())
    optype = np.array(
        [COLL_OPTYPE.get((g, o)) for g, o in zip(coll["grp"], coll["op"], strict=True)],
        dtype=object,
    )
    if pp == 2:  # a pp all_reduce joins the first and the last stage: the embedding's
        pp_ar = (coll["op"] == "all_reduce").to_numpy() & (coll["grp"] == "pp").to_numpy()
        optype[pp_ar] = "embedding-grads-all-reduce"
    if p2p.any():
        d = _direction(coll[p2p], comp, stage, pp, vpp)
        optype[p2p] = [f"{a}-{o}" for a, o in zip(d, coll["op"][p2p], strict=True)]
    mapped = np.array([o is not None for o in optype]) & ~inside
    counts["collectives_left_out"] = int((~mapped & ~inside).sum())
    coll, optype = coll[mapped], optype[mapped]
    dp_coll = np.isin(optype, ["grads-reduce-scatter", "params-all-gather"])
    return pd.DataFrame({
        "rank": coll["rank"].to_numpy(), "step": coll["step"].to_numpy(), "optype": optype,
        "t0": coll["t0"].to_numpy(), "t1": coll["t1"].to_numpy(),
        "mc": np.where(dp_coll, 0, -1), "mb_id": -1, "gmc": -1,
    })  # fmt: skip


def _trace_table(rows: pd.DataFrame, dp_rank: np.ndarray, stage: np.ndarray) -> pd.DataFrame:
    """The rows in the schema: times from each step's first event, ordered, numbered per op
    type, with each rank's dp rank and stage, in the schema's columns and types."""
    zero = rows.groupby("step")["t0"].transform("min")
    rows = rows.assign(
        start_ts=(rows["t0"] - zero).to_numpy(np.float64) / 1e9,
        duration=(rows["t1"] - rows["t0"]).clip(lower=0).to_numpy(np.float64) / 1e9,
    )
    rows = rows.sort_values(["rank", "step", "t0", "t1"], kind="stable").reset_index(drop=True)
    rows["seq_id"] = rows.groupby(["rank", "step", "optype"]).cumcount()
    r = rows["rank"].to_numpy()
    rows["dp_rank"] = dp_rank[r]
    rows["stage"] = stage[r]
    trace = pd.DataFrame({c: rows[c] for c in COLUMNS})
    for c in ("dp_rank", "stage", "rank", "seq_id", "mc", "mb_id", "gmc"):
        trace[c] = trace[c].astype(np.int32)
    trace["step"] = trace["step"].astype(np.int64)
    trace["optype"] = trace["optype"].astype("category")
    return trace


def export_whatif(run_dir: str, out_dir: str, one_per_tp_group: bool = False) -> dict[str, Any]:
    """Write ``out_dir/trace.parquet`` and ``out_dir/meta.yaml``; returns the export's counts."""
    import yaml

    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ExportError(f"--out {out_dir}: is a file, not a directory")
    trace, sizes, counts = build_trace(run_dir, one_per_tp_group)
    try:
        os.makedirs(out_dir, exist_ok=True)
        tmp = os.path.join(out_dir, f".trace.parquet.{os.getpid()}.tmp")
        trace.to_parquet(tmp, index=False)
        os.replace(tmp, os.path.join(out_dir, "trace.parquet"))
        with open(os.path.join(out_dir, "meta.yaml"), "w", encoding="utf-8") as f:
            yaml.safe_dump(sizes, f, sort_keys=False)
    except OSError as e:
        raise ExportError(f"--out {out_dir}: cannot write ({e.strerror or e})") from None
    return counts
