-- overlap_arrivals: the collectives each rank arrived at inside its own backward, steps
-- [$lo, $hi], that no wrapper of the tracer saw (read from Flight Recorder, `untimed` or
-- `flight_recorder`: DDP's reducer issues them from C++ as the backward runs): gradient
-- reduction overlapping the backward, whose late member its peers wait for inside their own
-- backward, where no call of theirs shows the wait. One row per (rank, collective), complete
-- instances of two or more members only.
-- columns: rank, step, group, gid, seq, arrival_ns, start_ns
--   arrival_ns  when the rank was ready (views/collective_rows.sql)
--   start_ns    the rank's step start: the first start of its spans in the step
with

backward as (
    select rank, step, start_ns, end_ns
    from spans
    where name = 'backward' and step between $lo and $hi and end_ns is not null
),

starts as (
    select rank, step, min(start_ns) as start_ns
    from spans
    where step between $lo and $hi and kind not in ('background', 'offload')
    group by rank, step
),

recorded as (
    select distinct rank, "group", seq
    from collectives
    where source in ('untimed', 'flight_recorder') and step between $lo and $hi
),

arrivals as (
    select rank, step, "group", gid, seq, group_size, arrival_ns
    from collective_rows
    semi join recorded using (rank, "group", seq)
    where
        step between $lo and $hi
        and op not in ('send', 'recv')
        and group_size >= 2
        and end_ns is not null
),

inside as (
    select distinct a.*
    from arrivals as a
    inner join backward as b
        on b.rank = a.rank and b.step = a.step and a.arrival_ns between b.start_ns and b.end_ns
),

complete as (
    select *
    from inside
    qualify count(*) over (partition by "group", gid, seq) = group_size
),

final as (
    select
        c.rank,
        c.step,
        c."group",
        c.gid,
        c.seq,
        c.arrival_ns,
        s.start_ns
    from complete as c
    inner join starts as s on s.rank = c.rank and s.step = c.step
)

select * from final
