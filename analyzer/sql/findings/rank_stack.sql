-- rank_stack: the latest stack taken of rank $rank (any thread; the main thread first).
-- columns: rank, ts_ns, reason, thread, stack
with

ranked as (
    select
        *,
        row_number() over (
            order by ts_ns desc, (thread ilike '%main%') desc
        ) as n
    from stacks
    where rank = $rank
),

final as (
    select rank, ts_ns, reason, thread, stack from ranked where n = 1
)

select * from final
