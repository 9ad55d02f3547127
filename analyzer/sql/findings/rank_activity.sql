-- rank_activity: when each rank was last heard from, over the whole run, and what it said.
-- columns: rank, last_step, last_ts_ns, last_state, n_stacks, n_hang_stacks, has_end,
--          has_hang_beat, has_records
--   last_step      the last step any of its records names (heartbeats, spans, collectives)
--   has_end        it wrote an `end` heartbeat (its tracer closed: it was alive at the end)
--   has_hang_beat  its watchdog wrote a `hang` heartbeat (no progress for the hang timeout)
--   n_hang_stacks  stacks taken of it because of a hang (by its watchdog or the launcher)
with

activity as (
    select rank, step, ts_ns, state from heartbeats
    union all
    select rank, step, last_ts_ns, null from digest_spans
    union all
    select rank, last_step, last_ts_ns, null from digest_frontier
),

per_rank as (
    select
        rank,
        max(step) as last_step,
        max(ts_ns) as last_ts_ns,
        arg_max(state, ts_ns) filter (where state is not null) as last_state,
        bool_or(state = 'end') as has_end,
        bool_or(state = 'hang') as has_hang_beat
    from activity
    group by rank
),

stack_counts as (
    select
        rank,
        count(*) as n_stacks,
        count(*) filter (where reason = 'hang') as n_hang_stacks
    from stacks
    group by rank
),

final as (
    select
        k.rank,
        p.last_step,
        p.last_ts_ns,
        p.last_state,
        coalesce(s.n_stacks, 0) as n_stacks,
        coalesce(s.n_hang_stacks, 0) as n_hang_stacks,
        coalesce(p.has_end, false) as has_end,
        coalesce(p.has_hang_beat, false) as has_hang_beat,
        p.rank is not null or s.rank is not null as has_records
    from rank_coords as k
    left join per_rank as p on p.rank = k.rank
    left join stack_counts as s on s.rank = k.rank
)

select * from final
