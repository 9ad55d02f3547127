-- pulse/frontier: how far the digests of `pulse_rows` (the digests files a pulse reads) reach
-- from step $from on (the first step not settled yet): per rank, its newest step and the newest
-- it closed (closed_step: its `step` span written; null where none); per file, its newest step
-- (a file without rows from $from on is not listed); and the first step of all (first_step, on
-- every row; null where no rows).
-- columns: what ('rank' | 'file'), rank, file, last_step, closed_step, first_step
with

first as (
    select min(step) as first_step from pulse_rows where step >= 0
),

recent as (
    select rank, step, filename, step_span_ns from pulse_rows where step >= $from and step >= 0
),

final as (
    select
        'rank' as what, rank, null as file, max(step) as last_step,
        max(step) filter (where step_span_ns is not null) as closed_step
    from recent
    group by rank
    union all
    select
        'file' as what, null as rank, filename as file, max(step) as last_step,
        null as closed_step
    from recent
    group by filename
)

select final.*, first.first_step from final cross join first
