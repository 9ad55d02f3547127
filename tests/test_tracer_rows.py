"""The tracer's rows by name (tracer/schema.py): the positions follow the schema, a row made by
name is the row the writer reads, and what a row holds past its columns (an in-flight
collective's group) is cut off before it is written."""

from __future__ import annotations

import pytest

from tracer import schema
from tracer.schema import C, S, W, make_row, row_columns
from tracer.writer import ROW_COLUMNS, to_columns


@pytest.mark.parametrize("table, positions", [("collectives", C), ("spans", S), ("work", W)])
def test_every_named_position_is_its_columns_place_in_a_row(table, positions):
    names = row_columns(table)
    assert names == ROW_COLUMNS[table] and "rank" not in names
    named = {k: v for k, v in vars(positions).items() if not k.startswith("_")}
    for column, at in named.items():
        if column not in ("width", "pg"):
            assert names[at] == column
    assert all(type(at) is int for at in named.values())  # plain ints: no cost on the hot path


def test_the_collectives_positions_name_every_column_and_the_group_comes_after_them():
    named = {k for k in vars(C) if not k.startswith("_")} - {"width", "pg"}
    assert named == set(row_columns("collectives"))
    assert C.width == len(row_columns("collectives")) == C.pg


def test_a_row_made_by_name_is_written_under_those_names():
    row = make_row("collectives", step=3, op="all_reduce", group="dp", seq=7, end_ns=20)
    assert row[C.step] == 3 and row[C.seq] == 7 and row[C.peer] is None
    cols, deferred = to_columns("collectives", [row], rank=2, offset_ns=100, resolve=None)
    assert deferred == []
    assert cols["rank"] == [2] and cols["op"] == ["all_reduce"] and cols["seq"] == [7]
    assert cols["end_ns"] == [120] and cols["issue_ns"] == [None]  # on rank 0's clock


def test_a_row_made_with_a_column_the_table_lacks_is_refused():
    with pytest.raises(KeyError, match="no column"):
        make_row("work", step=1, peer=3)


def test_buffered_rows_of_a_renamed_group_are_renamed_at_their_group_position():
    from tracer.collectives import Recorder

    rec = Recorder(None, 0, {}, "world")  # type: ignore[arg-type]  # no tracer needed here
    rec.renamed["world"] = "dp"
    work = make_row("work", step=1, kind="a2a_sent", key=3, value=64, group="world", seq=5)
    coll = make_row("collectives", step=1, op="all_reduce", group="world", seq=5)
    other = make_row("collectives", step=1, op="all_reduce", group="tp", seq=6)
    (w,) = rec.rename_rows([work], W.group)
    c, o = rec.rename_rows([coll, other])  # a collectives row's by default
    assert w[W.group] == "dp" and w[W.value] == 64 and len(w) == len(work)
    assert c[C.group] == "dp" and c[C.seq] == 5 and o == other


def test_the_schema_module_still_imports_only_pyarrow():
    # the analyzer and the importers share it without torch
    with open(schema.__file__, encoding="utf-8") as f:
        imports = [line for line in f if line.startswith(("import ", "from "))]
    assert imports == ["from __future__ import annotations\n", "import pyarrow as pa\n"]
