-- overlap_forwards: each rank's `forward` spans in steps [$lo, $hi] that hold no collective
-- (their time is the rank's own: an FSDP forward's all_gathers wait for peers), for the
-- straggler's late-arrival signal, which compares the forwards every rank ran at once.
-- columns: rank, step, microbatch, start_ns, end_ns
with

forwards as (
    select rank, step, microbatch, start_ns, end_ns
    from spans
    where name = 'forward' and step between $lo and $hi and end_ns is not null
),

holding as (
    select distinct f.rank, f.step
    from forwards as f
    inner join collective_rows as r
        on
            r.rank = f.rank
            and r.step = f.step
            and r.op not in ('send', 'recv')
            and r.arrival_ns between f.start_ns and f.end_ns
),

final as (
    select f.*
    from forwards as f
    anti join holding as h on h.rank = f.rank and h.step = f.step
)

select * from final
