-- overlap_arrivals: the collectives each rank arrived at inside its own backward, steps
-- [$lo, $hi], that no wrapper of the tracer saw (read from Flight Recorder, `untimed` or
-- `flight_recorder`: DDP's reducer issues them from C++ as the backward runs): gradient
-- reduction overlapping the backward, whose late member its peers wait for inside their own
-- backward, where no call of theirs shows the wait. One row per (rank, collective), complete
-- instances of two or more members only.
-- columns: rank, step, group, gid, seq, arrival_ns, start_ns, forward_ns
--   arrival_ns  when the rank was ready (views/collective_rows.sql)
--   start_ns    the rank's step start: the first start of its spans in the step
--   forward_ns  its `forward` spans in the step, summed (every microbatch's); null where a
--               forward holds a collective (its time is not all its own: FSDP's all_gathers)
with

backward as (
    select rank, step, start_ns, end_ns
    from spans
    where name = 'backward' and step between $lo and $hi and end_ns is not null
),

starts as (
    select
        rank,
        step,
        min(start_ns) as start_ns,
        coalesce(sum(end_ns - start_ns) filter (where name = 'forward'), 0) as forward_ns
    from spans
    where step between $lo and $hi and kind <> 'background'
    group by rank, step
),

forward_comm as (
    select distinct f.rank, f.step
    from spans as f
    inner join collective_rows as r
        on
            r.rank = f.rank
            and r.step = f.step
            and r.op not in ('send', 'recv')
            and r.arrival_ns between f.start_ns and f.end_ns
    where f.name = 'forward' and f.step between $lo and $hi
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
        s.start_ns,
        case when f.rank is null and s.forward_ns > 0 then s.forward_ns end as forward_ns
    from complete as c
    inner join starts as s on s.rank = c.rank and s.step = c.step
    left join forward_comm as f on f.rank = c.rank and f.step = c.step
)

select * from final
