-- rank_activity: when each rank was last heard from, over the whole run.
-- columns: rank, last_step, last_ts_ns, last_state, n_stacks
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
        arg_max(state, ts_ns) filter (where state is not null) as last_state
    from activity
    group by rank
),

stack_counts as (
    select rank, count(*) as n_stacks from stacks group by rank
),

final as (
    select k.rank, p.last_step, p.last_ts_ns, p.last_state, coalesce(s.n_stacks, 0) as n_stacks
    from rank_coords as k
    left join per_rank as p on p.rank = k.rank
    left join stack_counts as s on s.rank = k.rank
)

select * from final
