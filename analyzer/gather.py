"""Several nodes' partial run directories (paths or URLs) copied into one run:
:func:`gather`, the library behind ``megascope gather`` (analyzer/commands/gather.py) and
``megascope fleet``'s remote runs (analyzer/fleet.py). Every file is copied once, a path two
sources hold with different sizes refused, checkpoints left out unless asked for; the result is
written beside ``out`` and renamed into place, and its run.json merged from the nodes'.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from typing import Any

from tracer.cliutil import UsageError
from tracer.rundir import combined_status, fold_rank_notes, write_json_atomic

CHUNK = 8 << 20


def _filesystem(source: str) -> tuple[Any, str]:
    """(pyarrow file system, path in it) of a local path or a URL."""
    import pyarrow.fs as pafs

    if "://" in source:
        try:
            return pafs.FileSystem.from_uri(source)
        except Exception as e:  # pyarrow raises several types for a bad or unsupported URL
            raise UsageError(f"{source}: {str(e).splitlines()[0]}") from None
    path = os.path.abspath(source)
    if not os.path.isdir(path):
        raise UsageError(f"{source}: no such directory")
    return pafs.LocalFileSystem(), path


def _listing(fs: Any, root: str, checkpoints: bool) -> dict[str, int]:
    """Relative path -> size of every file to copy from one source."""
    import pyarrow.fs as pafs

    try:
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=False))
    except (OSError, FileNotFoundError) as e:
        raise UsageError(f"{root}: {str(e).splitlines()[0]}") from None
    out: dict[str, int] = {}
    base = root.rstrip("/") + "/"
    for info in infos:
        if info.type != pafs.FileType.File:
            continue
        rel = info.path[len(base) :] if info.path.startswith(base) else info.path
        name = rel.rsplit("/", 1)[-1]
        if name.endswith(".tmp") or name == ".compact.lock" or rel.startswith(".compact-"):
            continue  # half-written files, a compact's leftovers
        if rel.startswith("checkpoints/") and not checkpoints:
            continue
        out[rel] = int(info.size or 0)
    return out


def gather(sources: list[str], out: str, *, checkpoints: bool = False) -> dict[str, Any]:
    """Merge ``sources`` into the new run directory ``out``; returns what was done."""
    out = os.path.abspath(out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UsageError(f"{out} already exists (choose another --out)")
    plan: dict[str, tuple[Any, str, int]] = {}  # rel -> (fs, full path, size)
    run_json: list[tuple[str, Any, str]] = []
    for source in sources:
        fs, root = _filesystem(source)
        files = _listing(fs, root, checkpoints)
        if not files:
            raise UsageError(f"{source}: no files (not a run directory)")
        for rel, size in files.items():
            full = root.rstrip("/") + "/" + rel
            if rel == "run.json":
                run_json.append((source, fs, full))
                continue
            if rel in plan and plan[rel][2] != size:
                raise UsageError(
                    f"{rel}: in two sources with different contents (written by two nodes?)"
                )
            plan.setdefault(rel, (fs, full, size))
    if not run_json:
        raise UsageError("no source holds run.json (name node 0's run directory too)")
    texts = {_read_text(fs, path) for _, fs, path in run_json}
    if len(texts) > 1:
        raise UsageError(
            f"run.json differs in {', '.join(s for s, _, _ in run_json)} (two runs, not one)"
        )
    tmp = os.path.join(
        os.path.dirname(out), f".{os.path.basename(out)}.gather-{uuid.uuid4().hex[:6]}"
    )
    t0 = time.monotonic()
    nbytes = 0
    try:
        for rel, (fs, full, _) in sorted(plan.items()):
            dest = os.path.join(tmp, *rel.split("/"))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with fs.open_input_stream(full) as src, open(dest + ".tmp", "wb") as dst:
                while chunk := src.read(CHUNK):
                    dst.write(chunk)
                    nbytes += len(chunk)
            os.replace(dest + ".tmp", dest)
        meta = json.loads(texts.pop())
        _merge_meta(tmp, meta, sources)
        write_json_atomic(os.path.join(tmp, "run.json"), meta)
        if os.path.isdir(out):
            os.rmdir(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": out, "files": len(plan) + 1, "bytes": nbytes, "status": meta.get("status"),
            "seconds": time.monotonic() - t0}  # fmt: skip


def _read_text(fs: Any, path: str) -> str:
    with fs.open_input_stream(path) as f:
        return f.read().decode("utf-8")


def _merge_meta(run_dir: str, meta: dict[str, Any], sources: list[str]) -> None:
    """run.json's status, nodes and ranks_reporting from every node's outcome found."""
    progress = os.path.join(run_dir, ".progress")
    try:
        names = sorted(os.listdir(progress))
    except FileNotFoundError:
        names = []
    nodes = []
    for name in names:
        if name.startswith("node-") and name.endswith(".json"):
            try:
                with open(os.path.join(progress, name), encoding="utf-8") as f:
                    nodes.append(json.load(f))
            except (OSError, ValueError):
                continue
    keys = ("node", "host", "ranks", "status", "exit_code", "started_at", "ended_at")
    if nodes:
        meta["nodes"] = [{k: n.get(k) for k in keys} for n in nodes]
        if meta.get("status") != "running":  # a run still running stays so
            meta["status"] = combined_status(
                [meta.get("status")] + [n.get("status") for n in nodes]
            )
    summary = meta.get("summary")
    if isinstance(summary, dict):
        summary["ranks_reporting"] = sum(
            1 for n in names if n.startswith("rank-") and n[5:].isdigit()
        )
    fold_rank_notes(run_dir, meta)  # the entries of ranks whose node had no run.json
    meta["gathered_from"] = list(sources)
