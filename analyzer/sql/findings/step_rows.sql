-- step_rows: span and collective rows per step of [$lo, $hi] (from the digests), which is
-- about the number of operations the what-if replays in a step.
-- columns: step, n
with

rows_by_step as (
    select step, n_rows as n from digest_spans
    union all
    select step, n_rows as n from digest_collectives
),

final as (
    select step, sum(n) as n
    from rows_by_step
    where step between $lo and $hi
    group by step
)

select * from final
