"""The cluster model of helpers/world.py checks itself: a healthy world's steps view adds up."""

from __future__ import annotations

from helpers.world import MS, World, write_world


def test_world_healthy_steps_add_up(tmp_path):
    from analyzer.db import open_run

    write_world(World(steps=4), str(tmp_path))
    run = open_run(tmp_path)
    df = run.sql("select * from steps order by rank, step")
    assert len(df) == 8 * 4
    parts = df.compute_ns + df.exposed_comm_ns + df.idle_ns
    assert (parts <= df.step_ns).all()
    assert (df.compute_ns > 0).all() and (df.comm_ns > 0).all()
    # forward 3 x 10 ms, backward 3 x 20 ms, optimizer 5 ms: ~95 ms of compute a step
    assert 85 * MS < df.compute_ns.median() < 105 * MS
