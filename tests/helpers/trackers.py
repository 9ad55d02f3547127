"""Read back what megascope logged to a tracker, through the tracker's own reader: TensorBoard's
event files through its ``EventAccumulator``, an MLflow file store through ``MlflowClient``, and
an offline W&B run's ``run-ID.wandb`` file: its records, W&B's own protobuf messages
(``wandb.proto.wandb_internal_pb2.Record``), from the LevelDB-style log that wandb writes
(a 7-byte file header ``:W&B`` magic version, then 32 KiB blocks of records, each a 7-byte
header: CRC-32, length, type full|first|middle|last). wandb 0.2x kept a Python reader of it
(``wandb.sdk.internal.datastore``); its Go core writes the same format, and this reads it back
for the tests (no network, no wandb service)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path) -> list[Any]:
    """Every record of the file, parsed as ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert ident == b":W&B" and magic == 0xBEE1 and version in (0, 1), (ident, magic, version)
    out, pos, parts = [], HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's tail: zero padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0 and length == 0:  # padding
            pos += left
            continue
        if pos + HEADER + length > len(data):
            raise AssertionError(f"{path}: a record cut short at byte {pos} (still being written)")
        body = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            parts = body
        elif kind == FIRST:
            parts = body
            continue
        elif kind == MIDDLE:
            parts += body
            continue
        else:
            parts += body
        rec = pb.Record()
        rec.ParseFromString(parts)
        out.append(rec)
        parts = b""
    return out


def history(path: str | Path) -> list[dict[str, Any]]:
    """The rows ``run.log`` wrote, each as ``{key: value}`` (values JSON-decoded)."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in rec.history.item})  # fmt: skip
    return rows


def summary(path: str | Path) -> dict[str, Any]:
    """The run's summary as its last summary record left it."""
    out: dict[str, Any] = {}
    for rec in records(path):
        if rec.WhichOneof("record_type") == "summary":
            for item in rec.summary.update:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def run_file(wandb_dir: str | Path) -> Path:
    """The one ``run-*.wandb`` file under ``wandb_dir`` (its ``wandb/offline-run-*`` folders)."""
    found = sorted(Path(wandb_dir).rglob("run-*.wandb"))
    assert len(found) == 1, found
    kinds = [r.WhichOneof("record_type") for r in records(found[0])]
    assert "exit" in kinds, f"{found[0]}: the run was not written out (no exit record)"
    return found[0]


def tensorboard(log_dir: str | Path) -> Any:
    """TensorBoard's own reader of the event files in ``log_dir``, loaded in full."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def tensorboard_text(acc: Any, tag: str) -> list[tuple[int, str]]:
    """The (step, text) of each ``add_text`` under ``tag``."""
    return [
        (e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag + "/text_summary")
    ]


def mlflow_client(store: str | Path) -> Any:
    """An ``MlflowClient`` of the local file store at ``store`` (a directory)."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri="file:" + os.path.abspath(store))


def mlflow_text(client: Any, run_id: str, path: str, dst: str | Path) -> str:
    """An artifact of the run, downloaded into ``dst`` and read."""
    return Path(client.download_artifacts(run_id, path, str(dst))).read_text()
